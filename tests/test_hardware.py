"""Hardware probe, profiles and fit planner. NVML is faked at the `pynvml` module boundary; no GPU needed."""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pynvml
import pytest

from elastic_local import paths
from elastic_local.hardware.planner import (
    ArchShape,
    WeightOption,
    Workload,
    compute_gate,
    plan,
    rank_budgets,
    render_plan,
)
from elastic_local.hardware.probe import probe_machine
from elastic_local.hardware.profiles import (
    GIB,
    MIB,
    Profile,
    ProfileError,
    get_profile,
    list_profiles,
    load_profile_file,
    profile_from_probe,
    shipped_profile_dirs,
)

SHIPPED = ("rtx5080", "rtx5090", "rtx4090", "rtx4080", "rtx3090", "rtx3060-12gb", "jetson-agx-orin-64gb",
           "h100-80gb", "cpu")


# ---------------------------------------------------------------- probe (NVML faked at the module boundary)

def _err(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _raise(code: int):
    def fn(*args, **kwargs):
        raise _err(code)
    return fn


@pytest.fixture
def fake_gpu(monkeypatch):
    """One RTX 4090-like GPU with memory info v2; tests tweak single functions after applying it."""
    gib = GIB
    v1 = SimpleNamespace(total=24 * gib, free=20 * gib, used=4 * gib)
    v2 = SimpleNamespace(total=24 * gib, free=20 * gib, used=3 * gib + 512 * MIB, reserved=512 * MIB)
    procs = [SimpleNamespace(pid=4242, usedGpuMemory=2 * gib), SimpleNamespace(pid=os.getpid(),
                                                                                usedGpuMemory=gib)]
    calls = {"shutdown": 0}

    def memory(handle, version=None):
        return v2 if version else v1

    def shutdown():
        calls["shutdown"] += 1

    for name, fn in {
        "nvmlInit": lambda: None,
        "nvmlShutdown": shutdown,
        "nvmlSystemGetDriverVersion": lambda: "570.86.10",
        "nvmlSystemGetCudaDriverVersion": lambda: 12080,
        "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": lambda i: f"handle{i}",
        "nvmlDeviceGetName": lambda h: b"NVIDIA GeForce RTX 4090",
        "nvmlDeviceGetUUID": lambda h: f"GPU-0000-{h}",
        "nvmlDeviceGetMemoryInfo": memory,
        "nvmlDeviceGetCudaComputeCapability": lambda h: (8, 9),
        "nvmlDeviceGetComputeRunningProcesses": lambda h: procs,
        "nvmlDeviceGetGraphicsRunningProcesses": lambda h: procs[:1],
        "nvmlDeviceGetMemoryBusWidth": lambda h: 384,
        "nvmlDeviceGetMaxClockInfo": lambda h, clock: 10501,
    }.items():
        monkeypatch.setattr(pynvml, name, fn)
    return calls


def _assert_cpu_only(p, note_part: str):
    assert p.gpus == [] and any(note_part in n for n in p.notes), p.notes
    prof = profile_from_probe(p)
    assert prof.kind == "cpu" and prof.compute_capability is None
    assert prof.memory_bytes == p.ram_total_bytes and prof.available_bytes == p.ram_available_bytes
    assert note_part in prof.notes
    json.dumps(p.to_dict())


def test_probe_without_nvml_bindings(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # `import pynvml` raises ImportError
    _assert_cpu_only(probe_machine(), "NVML bindings not installed")


def test_probe_without_nvml_library(monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlInit", _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    _assert_cpu_only(probe_machine(), "NVML Shared Library Not Found")


def test_probe_driver_without_device(fake_gpu, monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 0)
    _assert_cpu_only(probe_machine(), "no GPU visible")
    assert fake_gpu["shutdown"] == 1


@pytest.mark.parametrize("fn", ["nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo",
                                "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetHandleByIndex"])
def test_probe_nvml_fails_mid_call(fake_gpu, monkeypatch, fn):
    monkeypatch.setattr(pynvml, fn, _raise(pynvml.NVML_ERROR_GPU_IS_LOST))
    p = probe_machine()
    _assert_cpu_only(p, "NVML failed mid-probe")
    assert any(fn in n and "GPU is lost" in n for n in p.notes)
    assert fake_gpu["shutdown"] == 1  # NVML is shut down even when a call fails


def test_probe_fake_gpu_memory_v2(fake_gpu):
    p = probe_machine()
    (g,) = p.gpus
    assert (g.name, g.compute_capability, g.sm) == ("NVIDIA GeForce RTX 4090", (8, 9), "sm_89")
    assert (g.memory_info_version, g.total_bytes, g.free_bytes, g.reserved_bytes) == (2, 24 * GIB, 20 * GIB,
                                                                                      512 * MIB)
    assert (p.driver_version, p.cuda_driver_version) == ("570.86.10", "12.8")
    assert g.memory_bandwidth_gbps == pytest.approx(1008.096)
    assert sorted(pr.pid for pr in g.processes) == sorted([4242, os.getpid()])  # one row per pid
    assert g.other_processes_bytes == 2 * GIB  # our own process is not "other"
    d = json.loads(json.dumps(p.to_dict()))
    assert d["gpus"][0]["compute_capability"] == "8.9"

    prof = profile_from_probe(p)
    assert (prof.name, prof.kind, prof.compute_capability) == ("auto", "cuda", (8, 9))
    assert prof.available_bytes == 20 * GIB  # free now: other processes and the driver are counted
    assert prof.memory_bandwidth_gbps == pytest.approx(1008.096)


def test_profile_from_probe_follows_torch_device(fake_gpu, monkeypatch):
    small = SimpleNamespace(total=8 * GIB, free=7 * GIB, used=GIB, reserved=0)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetCount", lambda: 2)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo",
                        lambda h, version=None: small if h == "handle1" else SimpleNamespace(
                            total=24 * GIB, free=20 * GIB, used=4 * GIB, reserved=0))
    p = probe_machine()
    assert [g.uuid for g in p.gpus] == ["GPU-0000-handle0", "GPU-0000-handle1"]
    assert profile_from_probe(p).available_bytes == 20 * GIB  # torch sees no GPU: NVML's first
    p.torch_gpu_uuid = "GPU-0000-handle1"  # CUDA's device 0 is NVML's device 1
    auto = profile_from_probe(p)
    assert auto.available_bytes == 7 * GIB and "1 of 2 GPUs" in auto.notes


def test_profile_from_probe_integrated_gpu(monkeypatch):
    monkeypatch.setattr(pynvml, "nvmlInit", _raise(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    p = probe_machine()  # a Jetson: NVML reports nothing, torch sees an integrated sm_87 GPU
    p.torch_cuda, p.torch_gpu_integrated, p.torch_gpu_capability, p.torch_gpu_name = True, True, (8, 7), "Orin"
    prof = profile_from_probe(p)
    assert (prof.kind, prof.compute_capability, prof.available_bytes) == ("unified", (8, 7),
                                                                          p.ram_available_bytes)


def test_probe_fake_gpu_without_memory_v2(fake_gpu, monkeypatch):
    v1 = SimpleNamespace(total=12 * GIB, free=11 * GIB, used=GIB)

    def memory(handle, version=None):
        if version:  # an old driver has no nvmlDeviceGetMemoryInfo_v2 entry point
            raise _err(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return v1

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", memory)
    for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
               "nvmlDeviceGetMemoryBusWidth", "nvmlDeviceGetUUID"):
        monkeypatch.setattr(pynvml, fn, _raise(pynvml.NVML_ERROR_NOT_SUPPORTED))
    (g,) = probe_machine().gpus
    assert (g.memory_info_version, g.total_bytes, g.free_bytes, g.reserved_bytes) == (1, 12 * GIB, 11 * GIB,
                                                                                      None)
    assert g.processes is None and g.other_processes_bytes == 0 and g.memory_bandwidth_gbps is None
    assert g.uuid is None


# ---------------------------------------------------------------- paths and profiles

def test_paths_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))
    assert paths.config_dir() == tmp_path and paths.data_dir() == tmp_path


@pytest.mark.skipif(paths.sys.platform != "linux", reason="XDG rules are Linux's")
def test_paths_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("ELASTIC_LOCAL_HOME", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    assert paths.config_dir() == tmp_path / "c" / "elastic-local"
    assert paths.data_dir() == tmp_path / "d" / "elastic-local"


@pytest.fixture
def no_user_profiles(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTIC_LOCAL_HOME", str(tmp_path))
    return tmp_path


def test_every_shipped_profile_loads(no_user_profiles):
    assert shipped_profile_dirs(), "shipped profiles folder not found"
    profiles = list_profiles()
    assert set(SHIPPED) <= set(profiles)
    for name, p in profiles.items():
        assert p.name == name and p.description and p.source
        assert 0 <= p.reserved_bytes < p.memory_bytes and p.memory_bandwidth_gbps > 0
        assert (p.compute_capability is None) == (p.kind == "cpu")
        json.dumps(p.to_dict())
    r5080 = profiles["rtx5080"]
    assert (r5080.memory_bytes, r5080.compute_capability, r5080.memory_bandwidth_gbps) == (16 * GIB, (12, 0),
                                                                                           960)
    assert profiles["jetson-agx-orin-64gb"].kind == "unified"


def test_user_profile_overrides_shipped(no_user_profiles):
    user = no_user_profiles / "profiles"
    user.mkdir()
    (user / "rtx5080.toml").write_text('description = "mine"\nkind = "cuda"\nmemory_bytes = 17_000_000_000\n'
                                       'compute_capability = "12.0"\nmemory_bandwidth_gbps = 900\n')
    assert get_profile("rtx5080").description == "mine"
    assert list_profiles()["rtx5080"].memory_bytes == 17_000_000_000
    assert get_profile("rtx4090").description.startswith("NVIDIA")
    with pytest.raises(ProfileError, match="no hardware profile named 'nope'"):
        get_profile("nope")


GOOD = {"description": '"x"', "kind": '"cuda"', "memory_gib": "16", "compute_capability": '"8.9"',
        "memory_bandwidth_gbps": "700"}


@pytest.mark.parametrize("change, field", [
    ({"memory_gib": None}, "memory_gib"),
    ({"memory_gib": "-1"}, "memory_gib"),
    ({"memory_bytes": "1"}, "memory_bytes"),  # both spellings given
    ({"kind": '"tpu"'}, "kind"),
    ({"compute_capability": '"sm_89"'}, "compute_capability"),
    ({"compute_capability": None}, "compute_capability"),
    ({"memory_bandwidth_gbps": '"fast"'}, "memory_bandwidth_gbps"),
    ({"reserved_mib": "99999"}, "reserved_mib"),
    ({"descripton": '"typo"'}, "descripton"),
    ({"name": '"other"'}, "name"),
    ({"description": None}, "description"),
    ({"cpu_kernels": '"yes"'}, "cpu_kernels"),
    ({"cpu_kernels": "true"}, "cpu_kernels"),  # on a GPU profile
])
def test_malformed_profile_names_file_and_field(tmp_path, change, field):
    fields = {**GOOD, **change}
    f = tmp_path / "bad.toml"
    f.write_text("".join(f"{k} = {v}\n" for k, v in fields.items() if v is not None))
    with pytest.raises(ProfileError) as e:
        load_profile_file(f)
    assert str(f) in str(e.value) and f"'{field}'" in str(e.value), str(e.value)


def test_invalid_toml_names_file(tmp_path):
    f = tmp_path / "broken.toml"
    f.write_text("kind = [\n")
    with pytest.raises(ProfileError, match="broken.toml: invalid TOML"):
        load_profile_file(f)


# ---------------------------------------------------------------- planner

def _shape(hidden: int, experts: int, mamba_heads: int) -> ArchShape:
    d_inner = mamba_heads * 64
    return ArchShape(hidden_size=hidden, vocab_size=131072, attn_layers=6, attn_heads=32, kv_heads=2,
                     head_dim=128, mamba_layers=23, mamba_heads=mamba_heads, mamba_head_dim=64, ssm_state=128,
                     conv_dim=d_inner + 2 * 8 * 128, conv_kernel=4, n_experts=experts, moe_topk=6,
                     moe_intermediate=1856, shared_intermediate=3712)


SHAPES = {"30B": _shape(2688, 128, 64), "23B": _shape(2688, 96, 64), "12B": _shape(2048, 64, 48)}
BF16 = {"30B": 58.9e9, "23B": 45.6e9, "12B": 24.0e9}  # bytes; FP8 ~0.53x and NVFP4 ~0.32x of these
ACTIVE = {"30B": 7.2e9, "23B": 5.6e9, "12B": 4.0e9}
SCALE = {"bf16": 1.0, "fp8": 31.4 / 58.9, "nvfp4": 18.7 / 58.9}
OPTIONS = [WeightOption(b, p, int(BF16[b] * s), int(ACTIVE[b] * s)) for b in ("12B", "30B", "23B")
           for p, s in SCALE.items()]  # deliberately not in size order: ranking is by bf16 bytes


def _by(pl, budget, precision):
    return next(c for c in pl.candidates if (c.budget, c.precision) == (budget, precision))


def test_rank_budgets():
    assert rank_budgets(OPTIONS) == ["30B", "23B", "12B"]
    no_bf16 = [o for o in OPTIONS if o.precision != "bf16"]
    assert rank_budgets(no_bf16) == ["12B", "30B", "23B"]  # no common yardstick: the order given


@pytest.mark.parametrize("name", SHIPPED)
def test_plan_on_every_shipped_profile(no_user_profiles, name):
    prof = get_profile(name)
    pl = plan(prof, SHAPES, OPTIONS, Workload(context=16384))
    assert pl.available_bytes == prof.memory_bytes - prof.reserved_bytes
    for c in pl.candidates:
        parts = c.weights_bytes + c.kv_bytes + c.state_bytes + c.workspace_bytes + c.overhead_bytes
        assert c.total_bytes == parts + c.margin_bytes
        assert c.fits == (c.total_bytes <= pl.available_bytes) and (c.reason == "") == c.fits
        assert c.decode_tps_ceiling == pytest.approx(prof.memory_bandwidth_gbps * 1e9 / _active(c))
    fitting_budgets = [b for b in ("30B", "23B", "12B") if any(_by(pl, b, p).fits for p in SCALE)]
    if not fitting_budgets:
        assert pl.pick is None and pl.to_dict()["pick"] is None
        return
    best = fitting_budgets[0]  # the largest budget that fits ...
    precision = next(p for p in SCALE if _by(pl, best, p).fits)  # ... at its best fitting precision
    assert (pl.pick.budget, pl.pick.precision) == (best, precision)
    d = json.loads(json.dumps(pl.to_dict()))
    assert d["pick"] == {"budget": best, "precision": precision, "total_bytes": pl.pick.total_bytes}
    assert {"budget", "precision", "total_bytes", "fits"} <= set(d["candidates"][0])


def _active(c) -> int:
    return next(o.active_bytes for o in OPTIONS if (o.budget, o.precision) == (c.budget, c.precision))


def test_expected_picks(no_user_profiles):
    picks = {n: plan(get_profile(n), SHAPES, OPTIONS).pick for n in ("rtx5080", "rtx4090", "h100-80gb")}
    assert (picks["rtx5080"].budget, picks["rtx5080"].precision) == ("12B", "fp8")
    assert (picks["rtx4090"].budget, picks["rtx4090"].precision) == ("30B", "nvfp4")  # 30B NVFP4 > 12B BF16
    assert (picks["h100-80gb"].budget, picks["h100-80gb"].precision) == ("30B", "bf16")


def test_kv_linear_in_context_state_constant(no_user_profiles):
    prof = get_profile("h100-80gb")
    kv, state = {}, {}
    for ctx in (1024, 2048, 4096, 8192):
        c = _by(plan(prof, SHAPES, OPTIONS, Workload(context=ctx)), "30B", "bf16")
        kv[ctx], state[ctx] = c.kv_bytes, c.state_bytes
        # oracle: caches x 2 (K, V) x 6 attention layers x 2 kv heads x 128 head_dim x ctx x 2 bytes
        assert c.kv_bytes == 2 * 2 * 6 * 2 * 128 * ctx * 2
    assert kv[2048] == 2 * kv[1024] and kv[8192] == 8 * kv[1024]
    assert len(set(state.values())) == 1
    # oracle: caches x 23 layers x (4 x conv_dim 6144 x 4 bytes + 64 heads x 64 x 128 state x 4 bytes)
    assert state[1024] == 2 * 23 * (4 * 6144 * 4 + 64 * 64 * 128 * 4)
    one = _by(plan(prof, SHAPES, OPTIONS, Workload(context=1024, caches=1, batch=3)), "30B", "bf16")
    assert one.kv_bytes == 3 * kv[1024] // 2
    minus_one = _by(plan(prof, SHAPES, OPTIONS, Workload(context=1024, conv_len=3)), "30B", "bf16")
    assert state[1024] - minus_one.state_bytes == 2 * 23 * 6144 * 4


def test_a_batch_on_two_caches_counts_its_sub_batches_copies_where_no_c_step_runs(no_user_profiles):
    """A batch whose rows think on one budget and answer on another decodes each budget's rows on copies
    of theirs where no C step steps them in place (a GPU, a CPU without the kernels: CacheSet.held): one
    more cache of every row. A CPU with the kernels, one cache, or one row holds none."""
    def rows(profile, **work):
        c = _by(plan(profile, SHAPES, OPTIONS, Workload(context=1024, **work)), "30B", "bf16")
        return c.kv_bytes, c.state_bytes

    gpu, cpu = get_profile("h100-80gb"), get_profile("cpu")
    kv, state = rows(gpu, caches=1)  # one row of one cache
    assert rows(gpu, batch=4) == (12 * kv, 12 * state)  # 2 caches x 4 rows + 4 copies
    assert rows(gpu, batch=4, caches=1) == (4 * kv, 4 * state) and rows(gpu) == (2 * kv, 2 * state)
    assert cpu.cpu_kernels and rows(cpu, batch=4) == (8 * kv, 8 * state)
    assert rows(dataclasses.replace(cpu, cpu_kernels=False), batch=4) == (12 * kv, 12 * state)


def test_precision_gate_notes(no_user_profiles):
    def note(profile, budget, precision):
        return _by(plan(get_profile(profile), SHAPES, OPTIONS), budget, precision)

    assert not note("rtx4090", "12B", "nvfp4").native and "dequantiz" in note("rtx4090", "12B", "nvfp4").note
    assert note("rtx4090", "12B", "fp8").native
    assert not note("rtx3090", "12B", "fp8").native and "dequantiz" in note("rtx3090", "12B", "fp8").note
    assert note("rtx5080", "12B", "nvfp4").native and "native nvfp4" in note("rtx5080", "12B", "nvfp4").note
    assert not note("jetson-agx-orin-64gb", "12B", "fp8").native
    assert note("cpu", "12B", "nvfp4").native and "in registers" in note("cpu", "12B", "nvfp4").note  # gemv.c
    # dequantizing needs a scratch matrix: workspace grows by one bf16 weight matrix, nothing else changes
    deq, nat = note("rtx4090", "12B", "nvfp4"), note("rtx5080", "12B", "nvfp4")
    assert deq.workspace_bytes - nat.workspace_bytes == 2 * SHAPES["12B"].largest_linear()

    turing = Profile("t4", "T4", "cuda", 16 * GIB, 320.0, compute_capability=(7, 5))
    native, text = compute_gate(turing, "bf16")
    assert not native and "fp16" in text and "sm_75" in text
    assert "to fp16" in compute_gate(turing, "fp8")[1]
    assert compute_gate(Profile("b", "B200", "cuda", GIB, 1.0, compute_capability=(10, 0)), "nvfp4")[0]


def test_margin_default_and_override(no_user_profiles):
    small, big = get_profile("rtx3060-12gb"), get_profile("h100-80gb")
    assert plan(small, SHAPES, OPTIONS).candidates[0].margin_bytes == GIB  # 5% of 11 GiB < 1 GiB
    assert plan(big, SHAPES, OPTIONS).candidates[0].margin_bytes == int(0.05 * big.available_bytes)
    c = plan(small, SHAPES, OPTIONS, Workload(margin_bytes=0, overhead_bytes=0)).candidates[0]
    assert (c.margin_bytes, c.overhead_bytes) == (0, 0)
    assert plan(small, SHAPES, OPTIONS).candidates[0].overhead_bytes == 500 * MIB  # CUDA context


def test_stored_preferred_over_load_time_quantization():
    prof = Profile("big", "big", "cuda", 200 * GIB, 1000.0, compute_capability=(12, 0))
    opts = [WeightOption("30B", "nvfp4", 10 * GIB, GIB, "load-time quantization"),
            WeightOption("30B", "nvfp4", 10 * GIB, GIB, "stored"),
            WeightOption("30B", "fp8", 20 * GIB, GIB, "load-time quantization")]
    pick = plan(prof, SHAPES, opts).pick
    assert (pick.precision, pick.source) == ("fp8", "load-time quantization")  # quality first
    pick = plan(prof, SHAPES, opts[:2]).pick
    assert pick.source == "stored"


def test_nothing_fits_and_bad_inputs():
    tiny = Profile("tiny", "tiny", "cpu", 4 * GIB, 50.0, reserved_bytes=GIB)
    pl = plan(tiny, SHAPES, OPTIONS)
    assert pl.pick is None and all(not c.fits and "GiB more than" in c.reason for c in pl.candidates)
    assert "none fits" in render_plan(pl)
    with pytest.raises(KeyError, match="7B"):
        plan(tiny, SHAPES, [WeightOption("7B", "bf16", GIB, GIB)])
    with pytest.raises(ValueError, match="precision"):
        WeightOption("12B", "int4", GIB, GIB)


def test_render_plan_table(no_user_profiles):
    pl = plan(get_profile("rtx4090"), SHAPES, OPTIONS)
    text = render_plan(pl)
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if "budget" in line and "precision" in line)
    rows = lines[header + 1: header + 1 + len(pl.candidates)]
    marked = [r for r in rows if r.startswith("*")]
    assert len(marked) == 1 and " 30B " in marked[0] and " nvfp4 " in marked[0]
    col = lines[header].index("total") + len("total")  # right-aligned numbers end under their header
    for r, c in zip(rows, pl.candidates, strict=True):
        assert r[:col].endswith(f"{c.total_bytes / GIB:.2f}")
    assert "23.00 GiB available" in text and lines[-1].startswith("pick: 30B nvfp4")


def test_cpu_profile_carries_a_measured_read_bandwidth(monkeypatch):
    """A machine without a GPU plans decode speed from its RAM bandwidth, measured, not guessed."""
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # no NVML: a CPU-only machine
    p = probe_machine()
    prof = profile_from_probe(p)
    assert prof.kind == "cpu" and prof.memory_bandwidth_gbps == p.ram_read_gbps > 0.1
    assert f"RAM read {p.ram_read_gbps:.1f} GB/s measured now" in prof.notes


def test_a_dequantized_precision_is_never_shown_faster_than_bf16(no_user_profiles):
    """A CPU without the C kernels (not x86, no compiler) runs fp8/nvfp4 by dequantizing to bf16 tile by
    tile: their ceiling is bf16's, even though they read fewer packed bytes, and they need a scratch matrix.
    Where they are read as stored (the CPU kernels, sm_120) they read fewer bytes and decode faster."""
    options = [dataclasses.replace(o, bf16_active_bytes=int(ACTIVE[o.budget])) for o in OPTIONS]
    kernels = get_profile("cpu")
    bare = dataclasses.replace(kernels, cpu_kernels=False)
    plans = {p: plan(prof, SHAPES, options, Workload(context=4096))
             for p, prof in (("bare", bare), ("kernels", kernels), ("gpu", get_profile("rtx5090")))}
    for b in SHAPES:
        bf16 = _by(plans["bare"], b, "bf16")
        for q in ("fp8", "nvfp4"):
            c = _by(plans["bare"], b, q)
            assert not c.native and "dequantizing" in c.note and c.decode_tps_ceiling == bf16.decode_tps_ceiling
            assert c.workspace_bytes > _by(plans["kernels"], b, q).workspace_bytes  # the scratch matrix
        for p in ("kernels", "gpu"):
            assert _by(plans[p], b, "nvfp4").decode_tps_ceiling > _by(plans[p], b, "fp8").decode_tps_ceiling \
                > _by(plans[p], b, "bf16").decode_tps_ceiling


def test_a_cpu_profile_says_whether_the_kernels_run(monkeypatch):
    """The live CPU profile carries the probe's answer; a profile file says it in `cpu_kernels`."""
    from elastic_local.model import gemv

    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)
    for runs in (True, False):
        monkeypatch.setattr(gemv, "runs_here", lambda runs=runs: runs)
        prof = profile_from_probe(probe_machine())
        assert prof.cpu_kernels is runs and prof.to_dict()["cpu_kernels"] is runs
        assert compute_gate(prof, "nvfp4")[0] is runs


def test_cuda_graph_steps_add_the_experts_each_row_gathers_on_a_gpu(no_user_profiles):
    """A CUDA-graph decode step (engine.load's default on a GPU) copies each row's routed experts into the
    graph's own memory pool (moe._experts_gathered), one pool per graph, one graph per cache: float
    weights all k experts at once, packed ones one slot at a time, dequantized. CPUs gather nothing."""
    def work(profile, precision, graphs, batch=1):
        w = Workload(context=4096, batch=batch, cuda_graphs=graphs)
        return _by(plan(get_profile(profile), SHAPES, OPTIONS, w), "30B", precision).workspace_bytes

    expert = 2688 * 1856  # hidden x expert channels
    float_row = 6 * 2 * expert * 2  # top-6 experts x (up + down) in bf16
    packed_row = expert * (2 * 2 + 5)  # one slot's up and down in bf16; one matrix's codes and int32 index
    assert work("h100-80gb", "bf16", True) - work("h100-80gb", "bf16", False) == 2 * float_row  # 2 caches
    assert work("h100-80gb", "bf16", True, batch=4) - work("h100-80gb", "bf16", False, batch=4) == 8 * float_row
    for precision in ("fp8", "nvfp4"):
        assert work("h100-80gb", precision, True) - work("h100-80gb", precision, False) == 2 * packed_row
    assert work("cpu", "bf16", True) == work("cpu", "bf16", False)
