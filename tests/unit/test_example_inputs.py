"""Bad inputs to the example engine: broken checkpoints, bad config.json, bad prompts and flags.

Each test builds its broken input from a tiny random checkpoint (examples/make_tiny_llama.py) and
checks the exact exception type and that the message names the file and the tensor or field, or
for the command lines exit status 2 and a single `error: ...` line on stderr without a traceback.
docs/bad_inputs.md lists every case with the test that covers it.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[2]

import bench_generate  # noqa: E402
import generate  # noqa: E402
from llm.config import (ConfigError, InvalidPromptError, UnsupportedModelError,  # noqa: E402
                        check_prompt_ids, load_config)
from llm.weights import (FLOAT_BITS, SAFETENSORS_DTYPES, CheckpointError,  # noqa: E402
                         CheckpointWarning, has_non_finite, load_weights, open_safetensors,
                         read_checkpoint, save_safetensors)
from make_tiny_llama import make_checkpoint  # noqa: E402

WEIGHTS = "model.safetensors"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"   # [256, 256] in the tiny model
K_PROJ = "model.layers.0.self_attn.k_proj.weight"   # [128, 256]
V_PROJ = "model.layers.0.self_attn.v_proj.weight"   # [128, 256]
SEED = 20240607  # the fixed seed of every random array made here


# --- building broken inputs ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A valid tiny Llama checkpoint (2 layers, hidden 256, vocab 320); tests work on copies."""
    return make_checkpoint(tmp_path_factory.mktemp("pristine") / "tiny", tokenizer=False)


@pytest.fixture(scope="module")
def pristine_sharded(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pristine") / "sharded", shards=2,
                           tokenizer=False)


@pytest.fixture
def model_dir(pristine, tmp_path):
    return Path(shutil.copytree(pristine, tmp_path / "model"))


@pytest.fixture
def sharded_dir(pristine_sharded, tmp_path):
    return Path(shutil.copytree(pristine_sharded, tmp_path / "sharded"))


def load(model_dir):
    """Config and weights of a checkpoint, as generate.py loads them on numpy."""
    return load_weights(model_dir, load_config(model_dir), np, np.float32, progress=False)


def edit_config(model_dir, drop=(), **changes):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    for key in drop:
        del config[key]
    path.write_text(json.dumps(config))


def rewrite_tensors(model_dir, change, file=WEIGHTS):
    """Apply change(dict of name -> array) to the tensors of one file and write it again."""
    path = model_dir / file
    tensors = {name: np.array(t) for name, t in open_safetensors(path).items()}
    change(tensors)
    save_safetensors(path, tensors)


def edit_header(model_dir, change, file=WEIGHTS):
    """Apply change(header dict) to the raw JSON header, keeping the data bytes as they are."""
    path = model_dir / file
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + length])
    change(header)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + blob[8 + length:])


def assert_names(error, *fragments):
    message = str(error)
    assert "\n" not in message
    for fragment in fragments:
        assert str(fragment) in message, message


# --- the command lines ----------------------------------------------------------------------------

def run_generate(capsys, model, *extra):
    """generate.main in this process: (exit status, stdout, stderr)."""
    args = ["--model", str(model), "--backend", "numpy", "--max-new-tokens", "2",
            *(extra if any(a.startswith("--prompt") for a in extra) else
              ("--prompt-ids", "1,2,3", *extra))]
    try:
        status = generate.main(args)
    except SystemExit as e:  # the argument parser exits
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def run_script(script, *args):
    """A CLI in a fresh interpreter, as a user runs it (warnings shown as __main__ sets them)."""
    return subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def progress_line(line) -> bool:
    return line.startswith("loading weights:")


def assert_one_error_line(status, out, err, *fragments, after_load=False):
    """Exit status 2, nothing on stdout, one `error: ` line on stderr naming `fragments`, no
    traceback. Errors found after the weights are read may follow the loader's progress line."""
    assert status == 2, err
    assert out == ""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    if after_load:
        lines = [line for line in lines if not progress_line(line)]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert str(fragment) in lines[0], err


# --- the safetensors file itself ------------------------------------------------------------------

def test_zero_byte_file(model_dir):
    (model_dir / WEIGHTS).write_bytes(b"")
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, "0 bytes")


def test_random_bytes(model_dir):
    rng = np.random.default_rng(SEED)
    (model_dir / WEIGHTS).write_bytes(rng.integers(0, 256, 100_000, dtype=np.uint8).tobytes())
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, "header length", "does not fit")


def test_truncated_header(model_dir):
    path = model_dir / WEIGHTS
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, path, "header length", "1000 bytes")


def test_header_not_json(model_dir):
    path = model_dir / WEIGHTS
    blob = bytearray(path.read_bytes())
    blob[8:16] = b"\xff{{{{{{{"  # the length stays right; the JSON is broken
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, path, "not valid JSON")


def test_truncated_data(model_dir):
    path = model_dir / WEIGHTS
    path.write_bytes(path.read_bytes()[:-5000])  # lm_head.weight is the last tensor
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, path, "lm_head.weight", "run past the end", "truncated")


def test_byte_count_mismatch(model_dir):
    def halve_q(header):
        header[Q_PROJ]["shape"] = [128, 256]  # the offsets still span [256, 256] floats
    edit_header(model_dir, halve_q)
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, Q_PROJ, "262144 bytes", "needs 131072")


def test_overlapping_tensors(model_dir):
    def share_bytes(header):
        header[V_PROJ]["data_offsets"] = header[K_PROJ]["data_offsets"]
    edit_header(model_dir, share_bytes)
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, K_PROJ, V_PROJ, "overlap")


def test_unknown_dtype(model_dir):
    def bogus(header):
        header[Q_PROJ]["dtype"] = "Q4_K"
    edit_header(model_dir, bogus)
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, Q_PROJ, "unknown dtype 'Q4_K'")


def test_wrong_dtype(model_dir):
    def to_int32(tensors):
        tensors[Q_PROJ] = tensors[Q_PROJ].astype(np.int32)
    rewrite_tensors(model_dir, to_int32)
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, Q_PROJ, "dtype I32")


def test_missing_tensor(model_dir):
    name = "model.layers.1.mlp.down_proj.weight"
    rewrite_tensors(model_dir, lambda tensors: tensors.pop(name))
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, name, "lacks tensor")


def test_wrong_shape(model_dir):
    name = "model.layers.1.mlp.up_proj.weight"   # [512, 256] in the tiny model

    def transpose(tensors):
        tensors[name] = np.ascontiguousarray(tensors[name].T)
    rewrite_tensors(model_dir, transpose)
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, name, "[256, 512]", "[512, 256]",
                 "intermediate_size, hidden_size")


@pytest.mark.parametrize("value, dtype", [(np.nan, "float32"), (np.inf, "float32"),
                                          (-np.inf, "bfloat16"), (np.nan, "float16")])
def test_non_finite_weights_warn(tmp_path, value, dtype):
    model_dir = make_checkpoint(tmp_path / dtype, dtype=dtype, tokenizer=False)
    names = [Q_PROJ, "model.norm.weight"]

    def poison(tensors):
        for name in names:
            tensors[name][0] = value
    rewrite_tensors(model_dir, poison)
    with pytest.warns(CheckpointWarning, match="NaN or infinity") as record:
        load(model_dir)
    assert_names(record[0].message, model_dir / WEIGHTS, *names, "2 tensor(s)")


def test_cli_non_finite_weights_warn_in_one_line(model_dir):
    rewrite_tensors(model_dir, lambda tensors: tensors["model.embed_tokens.weight"].fill(np.nan))
    result = run_script("generate.py", "--model", str(model_dir), "--backend", "numpy",
                        "--prompt-ids", "1,2", "--max-new-tokens", "2")
    assert result.returncode == 0 and "Traceback" not in result.stderr
    warning = [line for line in result.stderr.splitlines() if "NaN" in line]
    assert len(warning) == 1 and warning[0].startswith("warning: "), result.stderr
    assert str(model_dir / WEIGHTS) in warning[0] and "model.embed_tokens.weight" in warning[0]


def test_unused_tensor_warns(model_dir):
    def add_extra(tensors):
        tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(64, np.float32)
    rewrite_tensors(model_dir, add_extra)
    with pytest.warns(CheckpointWarning, match="ignoring 1 tensor") as record:
        load(model_dir)
    assert_names(record[0].message, model_dir / WEIGHTS, "model.layers.0.self_attn.q_norm.weight")


def test_ignored_tensors_do_not_warn(tmp_path):
    """A tied checkpoint that still stores lm_head, and older exports' rotary inv_freq, are
    ignored the way Hugging Face ignores them: no warning."""
    model_dir = make_checkpoint(tmp_path / "tied", tie=True, tokenizer=False)

    def add_ignored(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(32, np.float32)
    rewrite_tensors(model_dir, add_ignored)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(model_dir)


@pytest.mark.parametrize("dtype", ["F16", "BF16", "F32", "F64"])
def test_non_finite_check_sees_every_nan_and_infinity(dtype):
    """The bit test against np.isfinite, on the extremes: largest finite, smallest subnormal,
    zeros of both signs, infinities and NaNs of several payloads."""
    numpy_dtype = SAFETENSORS_DTYPES[dtype]
    limits = ml_dtypes.finfo(numpy_dtype)  # numpy's finfo does not know bfloat16
    finite = np.array([0.0, -0.0, 1.0, -2.5, limits.max, -limits.max, limits.smallest_subnormal],
                      numpy_dtype)
    assert not has_non_finite(finite, dtype, chunk_elements=3)
    unsigned = FLOAT_BITS[dtype][0]
    infinity = FLOAT_BITS[dtype][2]
    for bits in (infinity, infinity + 1, infinity | (infinity >> 1) | 1):  # inf, NaNs
        for sign in (0, 1):
            pattern = unsigned(bits) | (unsigned(sign) << unsigned(8 * finite.itemsize - 1))
            bad = finite.copy()
            bad.view(unsigned)[5] = pattern
            with np.errstate(invalid="ignore"):  # casting a NaN payload
                assert not np.isfinite(bad.astype(np.float64)).all()
            assert has_non_finite(bad, dtype, chunk_elements=3)


def test_valid_checkpoint_loads_without_warnings_and_memory_mapped(model_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weights = load(model_dir)
    assert weights.embed.shape == (320, 256) and len(weights.layers) == 2
    tensor = open_safetensors(model_dir / WEIGHTS)[Q_PROJ]
    while not isinstance(tensor, np.memmap) and tensor.base is not None:
        tensor = tensor.base
    assert isinstance(tensor, np.memmap)


def test_cli_missing_weights(model_dir, capsys):
    (model_dir / WEIGHTS).unlink()
    assert_one_error_line(*run_generate(capsys, model_dir), model_dir, "no model.safetensors")


def test_cli_broken_checkpoint_in_a_fresh_process(model_dir):
    (model_dir / WEIGHTS).write_bytes(b"")
    result = run_script("generate.py", "--model", str(model_dir), "--backend", "numpy",
                        "--prompt-ids", "1,2")
    assert_one_error_line(result.returncode, result.stdout, result.stderr,
                          model_dir / WEIGHTS, "0 bytes")


# --- sharded checkpoints --------------------------------------------------------------------------

def test_sharded_checkpoint_loads(sharded_dir, pristine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sharded = load(sharded_dir)
    single = load(pristine)
    np.testing.assert_array_equal(sharded.layers[1].gate_up, single.layers[1].gate_up)
    np.testing.assert_array_equal(sharded.lm_head, single.lm_head)


def shard_files(model_dir):
    return sorted(p.name for p in model_dir.glob("model-*.safetensors"))


def test_sharded_index_not_json(sharded_dir):
    index = sharded_dir / "model.safetensors.index.json"
    index.write_text('{"weight_map": {')
    with pytest.raises(CheckpointError) as info:
        load(sharded_dir)
    assert_names(info.value, index, "not valid JSON")


def test_sharded_missing_shard(sharded_dir):
    gone = shard_files(sharded_dir)[1]
    (sharded_dir / gone).unlink()
    with pytest.raises(CheckpointError) as info:
        load(sharded_dir)
    assert_names(info.value, sharded_dir / "model.safetensors.index.json", gone, "does not exist")


def test_sharded_index_points_to_the_wrong_shard(sharded_dir):
    index = sharded_dir / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    first, second = shard_files(sharded_dir)
    raw["weight_map"]["lm_head.weight"] = first if raw["weight_map"]["lm_head.weight"] == second \
        else second
    index.write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as info:
        load(sharded_dir)
    assert_names(info.value, index, "lm_head.weight", "has no such tensor")


def test_sharded_truncated_shard(sharded_dir):
    last = sharded_dir / shard_files(sharded_dir)[1]
    last.write_bytes(last.read_bytes()[:-5000])
    with pytest.raises(CheckpointError) as info:
        load(sharded_dir)
    assert_names(info.value, last, "lm_head.weight", "run past the end")


# --- config.json against the checkpoint -----------------------------------------------------------

@pytest.mark.parametrize("layers", [1, 3])
def test_layer_count_mismatch(model_dir, layers):
    edit_config(model_dir, num_hidden_layers=layers)
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, model_dir / "config.json", "has 2 decoder layers",
                 f"num_hidden_layers={layers}")


def test_head_dim_inconsistent(model_dir):
    edit_config(model_dir, head_dim=128)   # the checkpoint's heads are 64 wide
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, Q_PROJ, "[512, 256]",
                 "num_attention_heads*head_dim", "head_dim=128 differs")


def test_vocab_size_differs_from_the_embedding(model_dir):
    edit_config(model_dir, vocab_size=100)
    with pytest.raises(CheckpointError) as info:
        load(model_dir)
    assert_names(info.value, model_dir / WEIGHTS, "model.embed_tokens.weight", "[100, 256]",
                 "vocab_size")


def test_cli_vocab_size_differs(model_dir, capsys):
    edit_config(model_dir, vocab_size=100)
    # Ids under the configured vocabulary reach the loader, which finds the embedding too big;
    # larger ones are refused before anything is loaded.
    assert_one_error_line(*run_generate(capsys, model_dir, "--prompt-ids", "1,2"),
                          model_dir / WEIGHTS, "model.embed_tokens.weight")
    assert_one_error_line(*run_generate(capsys, model_dir, "--prompt-ids", "1,200"),
                          "prompt 0: token id 200 is outside the vocabulary [0, 100)")


# --- config.json by itself ------------------------------------------------------------------------

@pytest.mark.parametrize("changes, drop, error, fragments", [
    ({"hidden_size": 0}, (), ConfigError, ["hidden_size must be a positive integer", "0"]),
    ({"intermediate_size": -512}, (), ConfigError, ["intermediate_size must be a positive"]),
    ({"hidden_size": 256.5}, (), ConfigError, ["hidden_size", "256.5"]),
    ({"num_attention_heads": "4"}, (), ConfigError, ["num_attention_heads", "'4'"]),
    ({"num_hidden_layers": True}, (), ConfigError, ["num_hidden_layers", "True"]),
    ({}, ("vocab_size",), ConfigError, ["lacks 'vocab_size'"]),
    ({"num_key_value_heads": 3}, (), UnsupportedModelError, ["not a multiple",
                                                            "num_key_value_heads=3"]),
    ({"hidden_size": 250}, ("head_dim",), ConfigError, ["hidden_size=250 is not a multiple",
                                                        "no head_dim"]),
    ({"head_dim": 32, "hidden_size": 128}, (), UnsupportedModelError, ["head_dim=32"]),
    ({"rms_norm_eps": -1e-5}, (), ConfigError, ["rms_norm_eps must be a positive number"]),
    ({"rope_scaling": {"rope_type": "linear"}}, (), ConfigError, ["lacks 'factor'"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 4.0}}, (), ConfigError, ["high_freq_factor"]),
    ({"eos_token_id": "</s>"}, (), ConfigError, ["eos_token_id"]),
    ({"tie_word_embeddings": "yes"}, (), ConfigError, ["tie_word_embeddings must be true"]),
])
def test_bad_config_values(model_dir, changes, drop, error, fragments):
    edit_config(model_dir, drop, **changes)
    with pytest.raises(error) as info:
        load_config(model_dir)
    assert type(info.value) is error
    assert_names(info.value, model_dir / "config.json", *fragments)


def test_config_not_json(model_dir):
    (model_dir / "config.json").write_text('{"hidden_size": 256,')
    with pytest.raises(ConfigError) as info:
        load_config(model_dir)
    assert_names(info.value, model_dir / "config.json", "not valid JSON")


def test_config_not_an_object(model_dir):
    (model_dir / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError) as info:
        load_config(model_dir)
    assert_names(info.value, model_dir / "config.json", "expected a JSON object")


def test_generation_config_not_json(model_dir):
    (model_dir / "generation_config.json").write_bytes(b"\x00\xff garbage")
    with pytest.raises(ConfigError) as info:
        load_config(model_dir)
    assert_names(info.value, model_dir / "generation_config.json", "not valid JSON")


def test_cli_bad_config(model_dir, capsys):
    edit_config(model_dir, drop=("num_attention_heads",))
    assert_one_error_line(*run_generate(capsys, model_dir), model_dir / "config.json",
                          "lacks 'num_attention_heads'")


def test_cli_missing_config(model_dir, capsys):
    (model_dir / "config.json").unlink()
    assert_one_error_line(*run_generate(capsys, model_dir), model_dir / "config.json",
                          "not found")


@pytest.mark.parametrize("what", ["missing", "file"])
def test_cli_model_not_a_directory(tmp_path, capsys, what):
    path = tmp_path / "model"
    if what == "file":
        path.write_text("")
    assert_one_error_line(*run_generate(capsys, path), path,
                          "does not exist" if what == "missing" else "is not a directory")


# --- prompts --------------------------------------------------------------------------------------

@pytest.mark.parametrize("ids, fragment", [
    ("1,320", "token id 320 is outside the vocabulary [0, 320)"),
    ("-1,2", "token id -1 is outside the vocabulary"),
])
def test_cli_prompt_ids_outside_the_vocabulary(model_dir, capsys, ids, fragment):
    assert_one_error_line(*run_generate(capsys, model_dir, "--prompt-ids", "5",
                                        f"--prompt-ids={ids}"), "prompt 1", fragment)


def test_prompt_checks_come_before_any_forward(model_dir):
    config = load_config(model_dir)
    with pytest.raises(InvalidPromptError, match=r"prompt 0: token id 1000 .* \[0, 320\)"):
        check_prompt_ids([[1, 1000]], config)
    with pytest.raises(InvalidPromptError, match="prompt 1 has no tokens"):
        check_prompt_ids([[1], []], config)


def test_prompt_longer_than_the_model(model_dir, capsys):
    edit_config(model_dir, max_position_embeddings=8)
    assert_one_error_line(*run_generate(capsys, model_dir, "--prompt-ids", ",".join(["5"] * 8)),
                          "prompt 0 has 8 tokens", "at most 8")


# --- generate.py flags ----------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value, fragment", [
    ("--num-blocks", "-1", "must be an integer >= 1"),
    ("--num-blocks", "0", "must be an integer >= 1"),
    ("--num-blocks", "many", "expected an integer"),
    ("--temperature", "-1", "must be a number >= 0"),
    ("--temperature", "nan", "expected a finite number"),
    ("--top-p", "0", "in (0, 1]"),
    ("--top-p", "1.5", "in (0, 1]"),
    ("--top-k", "-1", "must be an integer >= 0"),
    ("--max-new-tokens", "0", "must be an integer >= 1"),
    ("--max-batch", "0", "must be an integer >= 1"),
    ("--seed", "-1", "must be an integer >= 0"),
    ("--block-size", "7", "invalid choice"),
    ("--kv-scale", "-1", "'calibrate' or a positive number"),
])
def test_cli_flag_out_of_range(model_dir, capsys, flag, value, fragment):
    assert_one_error_line(*run_generate(capsys, model_dir, flag, value), flag, fragment)


def test_cli_num_blocks_zero_in_a_fresh_process(model_dir):
    result = run_script("generate.py", "--model", str(model_dir), "--backend", "numpy",
                        "--prompt-ids", "1,2", "--num-blocks", "0")
    assert_one_error_line(result.returncode, result.stdout, result.stderr, "--num-blocks",
                          "must be an integer >= 1")


def test_cli_no_prompt(model_dir, capsys):
    status, out, err = run_generate(capsys, model_dir, "--prompt", "x")
    # With a tokenizer-less checkpoint, a text prompt is refused (generate.py's own check);
    # without any prompt the parser refuses.
    assert_one_error_line(status, out, err, "--prompt needs a tokenizer")
    try:
        generate.main(["--model", str(model_dir)])
    except SystemExit as e:
        status = e.code
    assert_one_error_line(status, *capsys.readouterr(), "at least one --prompt")


def test_cli_kv_cache_larger_than_memory(model_dir, capsys):
    assert_one_error_line(*run_generate(capsys, model_dir, "--num-blocks", str(10**12)),
                          "10" + "0" * 11 + " blocks", "GiB", after_load=True)


def test_cli_valid_run_still_works(model_dir, capsys):
    status, out, err = run_generate(capsys, model_dir, "--num-blocks", "4", "--block-size", "8",
                                    "--json")
    assert status == 0, err
    assert len(json.loads(out)["output_ids"]) == 2


# --- bench_generate.py flags (parsed before it looks for a GPU) -----------------------------------

@pytest.mark.parametrize("args, fragment", [
    (["--prompts", "0,8"], "must be an integer >= 1"),
    (["--prompts", ","], "expected comma-separated integers"),
    (["--output-lens", "x"], "expected an integer"),
    (["--input-len", "0"], "must be an integer >= 1"),
    (["--input-len", "4000"], "exceeds the model's 4096 positions"),
    (["--layers", "33"], "--layers must be from 1 to 32"),
    (["--attention", "fast"], "--attention: unknown"),
    (["--naive-prompts", "5"], "--naive-prompts 5: not among --prompts"),
    (["--block-size", "64"], "invalid choice"),
    (["--seed", "-2"], "must be an integer >= 0"),
    (["--json", "/nonexistent-dir/out.json"], "does not exist"),
])
def test_bench_flag_out_of_range(capsys, args, fragment):
    with pytest.raises(SystemExit) as info:
        bench_generate.parse_args(args)
    assert_one_error_line(info.value.code, *capsys.readouterr(), fragment)


def test_bench_bad_flag_in_a_fresh_process():
    result = run_script("bench_generate.py", "--layers", "0")
    assert_one_error_line(result.returncode, result.stdout, result.stderr, "--layers",
                          "must be an integer >= 1")


# --- any corruption of the file is a CheckpointError, never another exception --------------------

FUZZ = settings(max_examples=40, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(fraction=st.floats(0, 1, exclude_max=True))
def test_any_truncation_is_a_checkpoint_error(model_dir, fraction):
    path = model_dir / WEIGHTS
    blob = path.read_bytes()
    copy = model_dir.parent / "fuzz-truncated"
    shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    (copy / WEIGHTS).write_bytes(blob[:int(fraction * len(blob))])
    with pytest.raises(CheckpointError, match=str(copy / WEIGHTS)):
        read_checkpoint(copy)


@FUZZ
@given(position=st.integers(0, 2200), value=st.integers(0, 255))
def test_any_header_byte_change_loads_or_is_a_checkpoint_error(model_dir, position, value):
    """A changed byte in the length or JSON header (2168 bytes in the tiny model) either still
    describes a loadable checkpoint or raises CheckpointError."""
    blob = bytearray((model_dir / WEIGHTS).read_bytes())
    blob[position] = value
    copy = model_dir.parent / "fuzz-header"
    shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    (copy / WEIGHTS).write_bytes(bytes(blob))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            load(copy)
    except CheckpointError as e:
        assert str(copy) in str(e) and "\n" not in str(e)
