"""Pin the public surface: what each package exports, and the error tree's shape."""

import dmi
import dmi.catalog
from dmi.catalog import errors


def test_error_root_and_mixins():
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.DMIError), name
    assert issubclass(errors.PackNotFoundError, FileNotFoundError)
    assert issubclass(errors.RingFullError, TimeoutError)
    assert issubclass(errors.HookSelectionError, ValueError)
    assert issubclass(errors.CatalogUnavailableError, ConnectionError)


def test_every_error_is_drawn_in_the_tree():
    for name in errors.__all__:
        assert name in errors.__doc__, f"{name} missing from the error tree docstring"


def test_facade_reexports_errors():
    assert set(errors.__all__) <= set(dmi.__all__)
    for name in dmi.__all__:
        assert hasattr(dmi, name), name
