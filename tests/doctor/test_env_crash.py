"""The environment's crashes: the ISA table (host.isa, `isa` in --json) and the log findings for SIGILL, packages that
do not go together, a CUDA toolkit other than torch's, extensions built against another torch, and the OOM killer
while a checkpoint loads.

The ISA tests stub what the machine would answer (/proc/cpuinfo text, the kernel's arch_prctl answers); one test asks
this machine. The log tests read the real fixtures (tests/doctor/fixtures/real, index.json gives their threads).
"""

import ctypes
import json
import platform
import sys
import tomllib
from pathlib import Path

import pytest

from orbitctl.doctor import INFO, SKIP, UNKNOWN, WARN, Report, api, load_snapshot, run_checks, triage_log
from orbitctl.doctor.isa import ISA_FEATURES, isa_rows, probe_xstate, render_table
from orbitctl.doctor.probe_host import probe_cpu
from orbitctl.doctor.signatures import PINS
from orbitctl.doctor.snapshot import Isa, XState

HERE = Path(__file__).parent
REAL = HERE / "fixtures" / "real"
SNAPSHOTS = HERE / "fixtures" / "snapshots"
REPO = HERE.parents[1]

SPR_FLAGS = ("fpu sse4_2 xsave avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16 avx512_vnni avx512_fp16 "
             "amx_bf16 amx_tile amx_int8")
EPYC_FLAGS = "fpu sse4_2 xsave avx f16c fma avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"
XCR0_SPR, XCR0_ZEN4, XCR0_NO_AVX512 = 0x602E7, 0x2E7, 0x207
EOPNOTSUPP, EINVAL = 95, 22


def cpuinfo(tmp_path, flags, model="Intel(R) Xeon(R) Platinum 8480C"):
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nmodel name\t: {model}\nflags\t\t: {flags}\n")
    return str(path)


def xstate(xcr0=XCR0_SPR, request=0, permitted=True, xcr0_errno=None):
    return lambda: XState(status="ok", xcr0=xcr0, xcr0_errno=xcr0_errno, amx_request_errno=request,
                          amx_permitted=permitted)


def rows_of(cpu):
    return {r.feature: r for r in isa_rows(cpu.isa)}


def isa_finding(cpu):
    snap = load_snapshot(SNAPSHOTS / "no_gpu.json")
    snap.host.cpu = cpu
    return next(f for f in run_checks(snap) if f.id == "host.isa")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the table lists x86 ISA features")
def test_present_enabled_and_amx_granted_on_request(tmp_path):
    cpu = probe_cpu(cpuinfo(tmp_path, SPR_FLAGS), xstate=xstate())
    rows = rows_of(cpu)
    assert list(rows) == list(ISA_FEATURES)
    assert all(r.cpu == "present" for r in rows.values())
    assert {rows[f].os for f in ISA_FEATURES if not f.startswith("amx")} == {"enabled"}
    assert {rows[f].os for f in ("amx_tile", "amx_bf16", "amx_int8")} == {"granted on request"}
    finding = isa_finding(cpu)
    assert finding.status == INFO and finding.fix is None
    assert "XCR0 0x602e7 from the kernel" in finding.evidence[1]
    assert "amx_int8     present  granted on request" in finding.evidence
    assert finding.data["isa"][0] == {"feature": "avx2", "cpu": "present", "os": "enabled",
                                      "detail": "XCR0 0x602e7 has the YMM state", "errno": None}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the table lists x86 ISA features")
def test_amx_refused_with_errno_warns(tmp_path):
    cpu = probe_cpu(cpuinfo(tmp_path, SPR_FLAGS), xstate=xstate(xcr0=XCR0_ZEN4, request=EOPNOTSUPP, permitted=False))
    rows = rows_of(cpu)
    amx = rows["amx_tile"]
    assert amx.os == "refused" and amx.errno == EOPNOTSUPP
    assert "EOPNOTSUPP" in amx.detail and "lacks the XTILECFG and XTILEDATA states" in amx.detail
    assert amx.os_shown == "refused (errno 95 EOPNOTSUPP)"
    assert rows["avx512_fp16"].os == "enabled"
    finding = isa_finding(cpu)
    assert finding.status == WARN and "arch_prctl(ARCH_REQ_XCOMP_PERM" in finding.fix
    assert any(line.startswith("amx_tile: arch_prctl") for line in finding.evidence)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the table lists x86 ISA features")
def test_old_kernel_falls_back_to_what_cpuinfo_implies(tmp_path):
    # before Linux 5.16 both arch_prctl calls answer EINVAL: AVX states from the flags, AMX refused
    cpu = probe_cpu(cpuinfo(tmp_path, SPR_FLAGS), xstate=xstate(xcr0=None, xcr0_errno=EINVAL, request=EINVAL,
                                                                permitted=None))
    rows = rows_of(cpu)
    assert rows["avx2"].os == "enabled" and "implied" in rows["avx2"].detail and "before 5.16" in rows["avx2"].detail
    assert rows["avx512bw"].os == "enabled" and "avx512f" in rows["avx512bw"].detail
    assert rows["amx_bf16"].os == "refused" and "Linux before 5.16" in rows["amx_bf16"].detail


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the table lists x86 ISA features")
def test_state_missing_from_xcr0_is_disabled_and_amx_absent_on_epyc(tmp_path):
    cpu = probe_cpu(cpuinfo(tmp_path, EPYC_FLAGS, "AMD EPYC 9654"),
                    xstate=xstate(xcr0=XCR0_NO_AVX512, request=EOPNOTSUPP, permitted=False))
    rows = rows_of(cpu)
    assert rows["avx2"].os == "enabled"
    assert rows["avx512f"].os == "disabled" and "lacks the opmask and ZMM states" in rows["avx512f"].detail
    assert [(rows[f].cpu, rows[f].os) for f in ("amx_tile", "amx_bf16", "amx_int8")] == [("absent", "-")] * 3
    assert rows["avx512_fp16"].cpu == "absent"
    finding = isa_finding(cpu)
    assert finding.status == WARN and "XCR0 lacks their state" in finding.fix and "arch_prctl" not in finding.fix


def test_no_table_is_unknown_and_another_arch_skips(tmp_path):
    cpu = probe_cpu(str(tmp_path / "missing"))
    assert cpu.isa.status == "unreadable" and isa_finding(cpu).status == UNKNOWN
    old = load_snapshot(SNAPSHOTS / "no_gpu.json").host.cpu
    old.isa = Isa()  # an older snapshot without the table
    assert isa_finding(old).status == UNKNOWN
    arm = old.model_copy(update={"arch": "aarch64", "isa": Isa(status="not_x86")})
    assert isa_finding(arm).status == SKIP
    assert isa_rows(Isa(status="not_x86")) == [] and render_table([]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="arch_prctl is x86-64 Linux only")
def test_this_machine_asks_in_a_child_and_amx_rows_follow_cpuinfo():
    def own_permission():
        value = ctypes.c_uint64(0)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        rc = libc.syscall(ctypes.c_long(158), ctypes.c_long(0x1022), ctypes.byref(value))
        return value.value if rc == 0 else None

    before = own_permission()
    cpu = probe_cpu(xstate=probe_xstate)
    assert own_permission() == before  # the request ran in a child: the doctor's process is unchanged
    assert cpu.isa.xstate.status == "ok", cpu.isa.xstate.detail
    flags = set(Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0].split())
    rows = rows_of(cpu)
    for feature in ISA_FEATURES:
        assert rows[feature].cpu == ("present" if feature in flags else "absent"), feature
        if feature not in flags:
            assert rows[feature].os == "-"
    if "amx_tile" not in flags:  # this machine: an AMD EPYC without AMX
        assert {rows[f].os for f in ("amx_tile", "amx_bf16", "amx_int8")} == {"-"}
        assert cpu.isa.xstate.amx_request_errno != 0


def test_isa_is_in_the_json_report_and_the_human_table(monkeypatch, capsys):
    from orbitctl.cli.app import main

    snap = load_snapshot(SNAPSHOTS / "healthy_8xh100.json")
    monkeypatch.setattr(api, "take_snapshot", lambda gpu_probe=None, **_: snap)
    report = api.diagnose()
    assert [r["feature"] for r in report.isa] == list(ISA_FEATURES)
    assert report.to_dict()["isa"][-1] == {"feature": "amx_int8", "cpu": "present", "os": "granted on request",
                                           "detail": report.isa[-1]["detail"], "errno": None}
    assert Report().to_dict()["isa"] is None  # a log alone checks no machine
    assert main(["doctor", "--snapshot", str(SNAPSHOTS / "no_gpu.json"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["feature"]: r["os"] for r in doc["isa"]}["amx_tile"] == "-"
    assert main(["doctor", "--snapshot", str(SNAPSHOTS / "healthy_8xh100.json")]) == 0
    out = capsys.readouterr().out
    assert "host.isa" in out and "avx512_fp16" in out and "granted" in out  # the table (folded to the terminal)


# ---- log triage ----------------------------------------------------------------------------------------------------

def root(name):
    result = triage_log((REAL / name).read_text(encoding="utf-8"))
    return result.root_cause


def test_recorded_kernel_trap_names_libggml_cpu_and_the_native_build():
    rc = root("recorded-sapphire-rapids-vm-trap-invalid-opcode-libggml-cpu.log")
    assert rc.id == "log.host.sigill" and rc.status == "FAIL"
    assert "libggml-cpu" in rc.title and "native build for another CPU" in rc.title
    assert rc.data["library"] == "libggml-cpu.so.0" and rc.data["kind"] == "native_build"
    assert 'CMAKE_ARGS="-DGGML_NATIVE=OFF"' in rc.fix and "--no-cache-dir" in rc.fix and "host.isa" in rc.fix


def test_sigill_names_the_library_from_the_lines_around_it():
    amx = root("ipex-llm-8848-trap-invalid-opcode-libllama-amx.log")
    assert amx.data == {**amx.data, "library": "libllama_amx.so", "kind": "amx"}
    assert "AMX" in amx.title and "ARCH_REQ_XCOMP_PERM" in amx.fix and "XFEATURE_XTILEDATA" in amx.fix
    assert root("llama-cpp-python-839-illegal-instruction-trap-libllama.log").data["library"] == "libllama.so"
    assert root("llm-api-15-llama-cpp-backend-init-illegal-instruction.log").data["library"] == "llama_cpp"
    faulthandler = root("wcecoli-1107-fatal-python-error-illegal-instruction.log")
    assert faulthandler.data["library"] is None  # its crashing thread's frames are not in the paste: no guess
    assert root("qmcpack-2096-mpirun-rank1-signal-4-illegal-instruction.log").rank == 1


@pytest.mark.parametrize("line", [
    # the forms launchers and shells report a SIGILL in (exit code -4, 128 + 4 = 132, the signal's name)
    "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -4) local_rank: 0 (pid: 812917) of binary: x",
    "[launch.py:324:sigkill_handler] ['python', 'train.py'] exits with return code = -4",
    "subprocess.CalledProcessError: Command '['python', 'x.py']' died with <Signals.SIGILL: 4>.",
    "Signal 4 (SIGILL) received by PID 2198",
    "zsh: illegal hardware instruction  python train.py",
    "Error: llama runner process has terminated: exit status 132",
])
def test_every_sigill_form_is_named(line):
    rc = triage_log(line).root_cause
    assert rc.id == "log.host.sigill", line
    assert [f.id for f in triage_log(line).findings if f.id == "log.launcher"] == []  # the signal explains the exit


def test_versions_name_both_packages_and_orbitctls_pins():
    llava = root("llava-1794-peft-imports-encoderdecodercache-from-transformers.log")
    assert llava.id == "log.pkg.mismatch" and llava.data["packages"] == ["peft", "transformers"]
    assert llava.title.startswith("peft and transformers do not go together: peft imports EncoderDecoderCache")
    assert "'peft>=0.21,<0.22' 'transformers>=5.20,<6'" in llava.fix
    assert root("peft-3333-hybridcache-from-transformers-5.log").data["packages"] == ["peft", "transformers"]
    vllm = root("easyr1-27-pip-vllm-requires-torch.log")
    assert vllm.data["packages"] == ["vllm", "torch"] and vllm.data["found"] == "torch==2.4.0+cu124"
    assert "vLLM is not an orbitctl dependency" in vllm.fix and "torch>=2.6,<=2.14.1" in vllm.fix
    own_code = root("g-retriever-pr14-prepare-model-for-int8-training-from-peft.log")
    assert own_code.data["packages"] == ["peft"] and "written for another peft version" in own_code.title


def test_transformers_dependency_check_names_the_pair():
    # transformers' dependency_versions_check message (the form of transformers/utils/versions.py)
    rc = triage_log("ImportError: peft>=0.5.0 is required for a normal functioning of this module, but found "
                    "peft==0.4.0.").root_cause
    assert rc.id == "log.pkg.mismatch" and rc.data["packages"] == ["transformers", "peft"]
    assert rc.data["found"] == "peft==0.4.0"


def test_pins_are_pyprojects():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + [r for group in project["optional-dependencies"].values() for r in group]
    for name, spec in PINS.items():
        assert any(r.replace(" ", "").split(";")[0] == f"{name}{spec}" for r in requirements), name


def test_cuda_toolkit_mismatch_gives_both_versions():
    rc = root("researchprogress-11-torch-scatter-nvcc-10.1-torch-12.1.log")
    assert rc.id == "log.cuda.toolkit" and (rc.data["nvcc"], rc.data["torch_cuda"]) == ("10.1", "12.1")
    assert "CUDA_HOME=/usr/local/cuda-12.1" in rc.fix and "whl/cu101" in rc.fix
    deepspeed_form = root("lightseq-526-installed-cuda-12.3-torch-12.1.log")
    assert (deepspeed_form.data["nvcc"], deepspeed_form.data["torch_cuda"]) == ("12.3", "12.1")


def test_flash_attn_abi_fix_says_what_memory_flash_attention_is():
    rc = root("flash-attention-1691-cxx11abi-wheel-undefined-symbol.log")
    assert rc.id == "log.flash.abi" and rc.data["library"] == "flash_attn_2_cuda" and rc.data["torch_symbol"]
    assert "pip install flash-attn --no-build-isolation --no-cache-dir" in rc.fix
    assert "memory.flash_attention: true is PyTorch SDPA and false is eager attention" in rc.fix
    train = (REPO / "docs" / "train.md").read_text()
    assert 'loads the model with transformers\' `attn_implementation="sdpa"`' in train  # what the fix says it is
    assert '`false` loads it with `"eager"`' in train


def test_other_extension_built_for_another_torch():
    # vllm-project/vllm#1807: "vllm-0.2.2 is built with torch 2.1.0, when I tried to run vllm with torch 2.0.1"
    rc = triage_log("/usr/local/lib/python3.9/site-packages/vllm/quantization_ops.cpython-39-x86_64-linux-gnu.so: "
                    "undefined symbol: _ZN3c104cuda9SetDeviceEi").root_cause
    assert rc.id == "log.ext.abi" and rc.data["library"].startswith("quantization_ops")
    assert "torch>=2.6,<=2.14.1" in rc.fix


def test_host_oom_while_loading_a_checkpoint():
    rc = root("deepseek-vl2-90-checkpoint-shards-killed-dmesg.log")
    assert rc.id == "log.host.oom" and "while loading the checkpoint" in rc.title
    assert rc.data["during"] == "checkpoint_load" and rc.data["killed"]["pid"] == 576419
    assert "orbitctl plan PROFILE" in rc.fix and "tensor by tensor" in rc.fix and "own experts" in rc.fix
    glued = root("langchain-chatchat-35-checkpoint-shards-38-killed.log")  # "... 1.28it/s]Killed"
    assert glued.id == "log.host.oom" and glued.data["during"] == "checkpoint_load"
    training = root("deepspeed-3160-cpu-memory-then-9.log")  # killed while initialising the optimizer: no loading
    assert training.id == "log.host.oom" and "during" not in training.data and "checkpoint" not in training.title
