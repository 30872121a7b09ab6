"""llama.cpp side of the decode benchmark, through llama-cpp-python.

Three steps, each usable on its own:

    find_converter()                    -> llama.cpp's convert_hf_to_gguf.py (same version as the installed
                                           llama_cpp when it has to fetch one), or None
    convert_to_gguf(hf_dir, out_path)   -> an f32 GGUF of a Nemotron-H checkpoint in the hub layout
    decode_speed(gguf, prompt_ids, n)   -> (prefill tok/s, decode tok/s), greedy, batch 1

The converter insists on a tokenizer in the HF directory and on recognising its pre-tokenizer by a hash
of a test string. The benchmark feeds token ids directly, so the tokenizer only has to exist:
`ensure_tokenizer` writes a small byte-level BPE (GPT-2 regex pre-tokenizer; the converter pads the
vocabulary up to `vocab_size` with unused entries) and the conversion runs with the pre-tokenizer name
pinned to "gpt-2", which is what that tokenizer is.

Known limit of llama.cpp's Nemotron-H support: in an MoE model (`nemotron_h_moe`, any `E` layer) the
converter writes a feed-forward length only for `E` layers, so dense `-` layers load as attention layers
and fail. `unsupported_reason(config)` says so before trying.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

WORK_DIR = Path(__file__).resolve().parent / "_work"

# Runs llama.cpp's converter in a child process with the pre-tokenizer check pinned (see module docstring).
_CONVERT_WRAPPER = """
import runpy, sys
from pathlib import Path
script = Path(sys.argv[1])
sys.argv = [str(script), *sys.argv[2:]]
sys.path[:0] = [str(script.parent), str(script.parent / "gguf-py")]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path(str(script), run_name="__main__")
"""


def n_threads() -> int:
    """The machine's cores available to this process; every engine in the benchmark uses this many."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def installed_version() -> str | None:
    try:
        import llama_cpp
    except Exception:  # noqa: BLE001 - a broken build raises OSError/RuntimeError, not only ImportError
        return None
    return getattr(llama_cpp, "__version__", None)


def import_error() -> str | None:
    """None when llama_cpp imports, else the reason it does not."""
    try:
        import llama_cpp  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------- converter


def _converter_in(root: Path) -> Path | None:
    for cand in (root / "convert_hf_to_gguf.py", root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"):
        if cand.is_file() and (cand.parent / "gguf-py").is_dir():
            return cand
    return None


def _fetch_sdist(version: str) -> Path | None:
    """pip-download the llama-cpp-python sdist of `version` and unpack the converter parts into _work."""
    dest = WORK_DIR / f"llama_cpp_python-{version}"
    found = _converter_in(dest)
    if found:
        return found
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q",
           "-d", str(WORK_DIR), f"llama-cpp-python=={version}"]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        return None
    sdist = WORK_DIR / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        return None
    wanted = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/",
              "vendor/llama.cpp/gguf-py/")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.split("/", 1)[-1].startswith(wanted)]
        tar.extractall(WORK_DIR, members=members, filter="data")
    sdist.unlink()  # 75 MB, mostly llama.cpp sources the converter does not need
    return _converter_in(dest)


def find_converter() -> Path | None:
    """llama.cpp's convert_hf_to_gguf.py.

    Looks at $LLAMA_CPP_DIR (a llama.cpp checkout or an unpacked llama-cpp-python sdist), then at an sdist
    already unpacked under benchmarks/_work, then downloads the sdist matching the installed llama_cpp.
    """
    if env := os.environ.get("LLAMA_CPP_DIR"):
        if found := _converter_in(Path(env)):
            return found
    version = installed_version()
    if version and (found := _converter_in(WORK_DIR / f"llama_cpp_python-{version}")):
        return found
    for root in sorted(WORK_DIR.glob("llama_cpp_python-*"), reverse=True):
        if found := _converter_in(root):
            return found
    return _fetch_sdist(version) if version else None


def supports_nemotron_h(converter: Path) -> bool:
    """Both halves present: the converter class and the runtime architecture."""
    root = converter.parent
    conv_src = "".join(p.read_text() for p in [converter, *sorted((root / "conversion").glob("*.py"))]
                       if p.is_file())
    arch_src = root / "src" / "llama-arch.cpp"
    has_arch = (not arch_src.is_file()) or "nemotron_h_moe" in arch_src.read_text()
    return "NemotronHForCausalLM" in conv_src and has_arch


def unsupported_reason(config: dict) -> str | None:
    """Why llama.cpp cannot run this Nemotron-H config, or None."""
    pattern = config.get("hybrid_override_pattern") or _pattern(config.get("layers_block_type") or [])
    if "E" in pattern and "-" in pattern:
        return ("llama.cpp's nemotron_h_moe has no dense '-' layers in an MoE model "
                "(the converter gives them n_ff=0, so they load as attention layers)")
    return None


def _pattern(layer_types: Sequence[str]) -> str:
    letters = {"mamba": "M", "linear_attention": "M", "moe": "E", "attention": "*", "full_attention": "*",
               "mlp": "-"}
    return "".join(letters[t] for t in layer_types)


# ---------------------------------------------------------------------------------------------- tokenizer


def ensure_tokenizer(hf_dir: Path, max_vocab: int = 1024) -> None:
    """Write tokenizer.json + tokenizer_config.json (byte-level BPE, ids 0/1/2 = pad/bos/eos) if missing."""
    hf_dir = Path(hf_dir)
    if (hf_dir / "tokenizer.json").is_file() and (hf_dir / "tokenizer_config.json").is_file():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    specials = ["<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, max_vocab), special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [__doc__ or "", "The quick brown fox jumps over the lazy dog. 0123456789\n"] * 8
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() <= vocab_size, "tokenizer larger than the model's vocabulary"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(hf_dir))


# ---------------------------------------------------------------------------------------------- convert


def convert_to_gguf(hf_dir: Path, out_path: Path) -> Path:
    """Convert an HF Nemotron-H directory (hub layout) to an f32 GGUF at `out_path`; reuses a fresh one."""
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    newest_input = max(p.stat().st_mtime for p in hf_dir.glob("*.safetensors"))
    if out_path.is_file() and out_path.stat().st_mtime >= newest_input:
        return out_path
    converter = find_converter()
    if converter is None:
        raise RuntimeError("llama.cpp's convert_hf_to_gguf.py not found (set LLAMA_CPP_DIR)")
    if not supports_nemotron_h(converter):
        raise RuntimeError(f"{converter} has no NemotronHForCausalLM / nemotron_h_moe support")
    ensure_tokenizer(hf_dir)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", _CONVERT_WRAPPER, str(converter), str(hf_dir),
           "--outtype", "f32", "--outfile", str(out_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"convert_hf_to_gguf failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return out_path


def quantize_gguf(f32_path: Path, kind: str) -> Path:
    """llama.cpp's own Q8_0 / Q4_0 of an f32 GGUF (next to it; reused when fresh). The output tensor
    (lm_head) stays f32, as our FP8 / NVFP4 keep lm_head in high precision: the same weights quantized."""
    import llama_cpp

    f32_path = Path(f32_path)
    out = f32_path.with_name(f"model-{kind}.gguf")
    if out.is_file() and out.stat().st_mtime >= f32_path.stat().st_mtime:
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[kind]
    params.quantize_output_tensor = False
    if llama_cpp.llama_model_quantize(str(f32_path).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize {kind} of {f32_path} failed")
    return out


# ---------------------------------------------------------------------------------------------- timing


class LlamaCppRunner:
    """One loaded GGUF; `run` does a greedy prefill + decode and returns the wall times."""

    def __init__(self, gguf_path: Path, n_ctx: int, threads: int | None = None) -> None:
        import llama_cpp

        self._lib = llama_cpp
        threads = threads or n_threads()
        self.llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                   n_threads=threads, n_threads_batch=threads, n_gpu_layers=0,
                                   logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _argmax_last(self) -> int:
        import numpy as np

        ptr = self._lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def run(self, prompt_ids: Sequence[int], n_new: int) -> tuple[float, float, list[int]]:
        """(prefill seconds incl. first token, seconds for the other n_new - 1 tokens, generated ids)."""
        self.llm.reset()  # n_tokens = 0 and, for hybrid/recurrent models, clears the Mamba states
        t0 = time.perf_counter()
        self.llm.eval(list(prompt_ids))
        out = [self._argmax_last()]
        t1 = time.perf_counter()
        for _ in range(n_new - 1):
            self.llm.eval([out[-1]])
            out.append(self._argmax_last())
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out


def decode_speed(
    gguf_path: Path, prompt_ids: Sequence[int], n_new: int, reps: int = 3
) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s): median over `reps` runs after one warm-up, n_threads = cores."""
    from statistics import median

    runner = LlamaCppRunner(gguf_path, n_ctx=len(prompt_ids) + n_new + 8)
    runner.run(prompt_ids, min(n_new, 4))
    prefill, decode = [], []
    for _ in range(reps):
        t_pre, t_dec, _ = runner.run(prompt_ids, n_new)
        prefill.append(len(prompt_ids) / t_pre)
        decode.append((n_new - 1) / t_dec)
    return median(prefill), median(decode)


if __name__ == "__main__":  # python benchmarks/llamacpp.py HF_DIR OUT.gguf
    conv = find_converter()
    print("converter:", conv, "| nemotron-h:", conv and supports_nemotron_h(conv))
    if len(sys.argv) == 3:
        print(convert_to_gguf(Path(sys.argv[1]), Path(sys.argv[2])))
