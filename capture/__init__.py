"""``dmi.capture``: hooks on Hugging Face models, the ring of host slots and the drain thread.

::

    from dmi.capture import attach
    with attach(model, hooks="resid_post", layers=range(4), store=store, catalog=catalog) as cap:
        request_ids, out = cap.generate(input_ids, attention_mask=mask, max_new_tokens=16)
    # every captured record is now in sealed packs, published in the catalog

See ``docs/capture.md``.
"""

from ._aliases import ALIASES, HookAlias, resolve_alias
from ._arch import SUPPORTED_MODEL_TYPES, hooks_ruled_out, resolve_architecture
from ._generate import CaptureResult, prepare_batch
from ._hooks import GROUPS, HOOKS, HookSpec, ModelGeometry
from ._plan import RowSpan, StepPlan
from ._ring import Ring
from ._schedule import Schedule
from ._selection import MAX_SELECTED_LAYERS, Selection, layer_numbers, resolve_hooks, resolve_layers
from ._session import CaptureSession, attach, derive_model_id, new_run_id
from ._tp import ParallelRanks, resolve_parallel_ranks, tp_mesh_of
from ._tp_layout import TPReplicated, TPShard
from ._tp_load import load_tensor_parallel
from ._token_text import PROMPT_TEXT, TEXT_HOOKS, TOKEN_TEXT, decode_strings
from ._vllm import VLLM_WRITER_PREFIX, VLLMCaptureSession, attach_vllm, check_engine_config, engine_in_this_process
from ._vllm_arch import VLLM_MODEL_TYPES

__all__ = [
    "attach",
    "CaptureSession",
    "CaptureResult",
    "Schedule",
    "HOOKS",
    "GROUPS",
    "HookSpec",
    "ModelGeometry",
    "resolve_hooks",
    "resolve_layers",
    "layer_numbers",
    "MAX_SELECTED_LAYERS",
    "Selection",
    "StepPlan",
    "RowSpan",
    "Ring",
    "prepare_batch",
    "derive_model_id",
    "resolve_architecture",
    "SUPPORTED_MODEL_TYPES",
    "hooks_ruled_out",
    "VLLM_MODEL_TYPES",
    "ALIASES",
    "HookAlias",
    "resolve_alias",
    "TPShard",
    "TPReplicated",
    "ParallelRanks",
    "resolve_parallel_ranks",
    "tp_mesh_of",
    "load_tensor_parallel",
    "TOKEN_TEXT",
    "PROMPT_TEXT",
    "TEXT_HOOKS",
    "decode_strings",
    "attach_vllm",
    "VLLMCaptureSession",
    "check_engine_config",
    "VLLM_WRITER_PREFIX",
    "engine_in_this_process",
    "new_run_id",
]
