"""Pin the public surface: what each package exports, and the error tree's shape."""

import dmi
import dmi.catalog
from dmi.storage import errors


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


# --- the public surface of each package, pinned: a change here must be deliberate ------------

DMI_ALL = [
    "__version__", "open", "capture", "capture_vllm", "Store", "LazyInternal", "ModelSummary", "RequestSummary", "HookSummary",
    "RequestContents", "Loss", "VerifyReport", "Problem", "RecoveredPack", "TokenLoader", "ShuffleQuality",
    "RunSummary", "DeleteReport", "AuditReport", "AuditCheck", "default_home", "load_model", "LoadedModel",
    "CapturePlan", "load_plan", "dump_plan", "RequestTokens",
]

CAPTURE_ALL = [
    "attach", "CaptureSession", "CaptureResult", "Schedule", "HOOKS", "GROUPS", "HookSpec", "ModelGeometry",
    "resolve_hooks", "resolve_layers", "layer_numbers", "MAX_SELECTED_LAYERS", "Selection", "StepPlan", "RowSpan", "Ring", "prepare_batch",
    "derive_model_id", "resolve_architecture", "SUPPORTED_MODEL_TYPES", "hooks_ruled_out", "VLLM_MODEL_TYPES", "ALIASES", "HookAlias", "resolve_alias",
    "TPShard", "TPReplicated", "ParallelRanks", "resolve_parallel_ranks", "tp_mesh_of", "load_tensor_parallel",
    "TOKEN_TEXT", "PROMPT_TEXT", "TEXT_HOOKS", "decode_strings", "attach_vllm", "VLLMCaptureSession",
    "check_engine_config", "VLLM_WRITER_PREFIX", "engine_in_this_process",
    "new_run_id",
]

STORAGE_ALL = [
    "PHASES", "GLOBAL_LAYER", "HOOK_ORDER", "TOKEN_TEXT", "PROMPT_TEXT", "TEXT_HOOKS", "RecordKey", "ShardGeometry", "RecordStats", "ByteRange", "RecordMeta", "RecordEntry",
    "PackDescriptor", "CODECS", "DEFAULT_CODEC", "LOSSY_CODECS", "CodecError", "checksum", "decode", "gather_rows", "FORMAT_NAME",
    "FORMAT_VERSION", "dtype_name", "torch_dtype", "dtype_itemsize", "encode_strings", "decode_strings", "pack_strings", "NO_STRING", "read_pack_descriptor", "read_pack_index", "verify_pack", "WholePack", "read_whole_pack", "check_whole_pack", "PackStore", "LocalPackStore", "FileSystemPackStore", "S3PackStore", "PackInput", "PackSink", "DIRECT_ALIGNMENT", "PackWriter",
    "DEFAULT_MAX_RECORDS", "DEFAULT_MAX_BYTES",
]

CATALOG_ALL = [
    "open_catalog", "default_catalog_uri", "CATALOG_ENV", "HOME_ENV", "Catalog", "HookContents", "ModelTotals",
    "RequestTotals", "Deletion", "Publisher",
    "Watermark", "validate_value_id",
]

READER_ALL = [
    "read_record", "read_records", "read_raw_records", "read_by_key", "find_record", "load_footer", "check_records",
    "PackFooter", "plan_reads",
    "PlannedRead", "DEFAULT_MAX_GAP", "FooterCache", "CacheStats", "assemble",
]


def test_dmi_all_is_pinned():
    assert dmi.__all__ == [*DMI_ALL, *errors.__all__]


def test_layer_packages_all_are_pinned():
    import dmi.capture
    import dmi.reader
    import dmi.storage

    assert dmi.capture.__all__ == CAPTURE_ALL
    assert dmi.storage.__all__ == [*errors.__all__, *STORAGE_ALL]
    assert dmi.catalog.__all__ == CATALOG_ALL
    assert dmi.reader.__all__ == READER_ALL
    for package in (dmi.capture, dmi.catalog, dmi.reader, dmi.storage):
        for name in package.__all__:
            assert hasattr(package, name), (package.__name__, name)


def test_every_public_callable_of_the_facade_says_what_it_returns_and_raises():
    import inspect

    for name in ("open", "capture"):
        doc = inspect.getdoc(getattr(dmi._store, name))
        assert "Raises" in doc and ("Returns" in doc or "Yields" in doc), name
    for cls in (dmi.Store, dmi.LazyInternal):
        for name, member in inspect.getmembers(cls):
            if not name.startswith("_") and (callable(member) or isinstance(member, property)):
                assert inspect.getdoc(member), f"{cls.__name__}.{name} has no docstring"
    reading = ("requests", "contents", "tokens", "get_internal", "lazy", "sql", "verify", "recover")
    for name in reading:
        assert "Raises" in inspect.getdoc(getattr(dmi.Store, name)), f"Store.{name} does not say what it raises"


def test_the_storage_layers_hook_order_is_the_catalogues():
    """``dmi.storage.HOOK_ORDER`` (what listing commands sort by without loading torch) is the
    capture catalogue's order, and the text record names are the same objects in both."""
    import dmi.capture
    import dmi.storage

    assert dmi.storage.HOOK_ORDER == tuple(dmi.capture.HOOKS)
    assert dmi.storage.TEXT_HOOKS is dmi.capture.TEXT_HOOKS
