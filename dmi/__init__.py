"""DMI: capture the internals of a language model, keep them, query them, read them back."""

from dmi.catalog.errors import *  # noqa: F403
from dmi.catalog import errors as _errors

__version__ = "0.1.0"

__all__ = ["__version__", *_errors.__all__]
