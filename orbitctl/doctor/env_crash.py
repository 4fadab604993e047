"""The environment's crashes, read closer: which library a SIGILL names and why, which two packages do not go together,
which CUDA versions differ, which extension lost its torch symbols, and whether the OOM killer struck while a
checkpoint was loading.

``enrich`` rewrites a log finding's title, fix and data from its events (their line and ``Event.window``, the lines
around it that orbitctl.doctor.logscan.CONTEXT_LINES keeps).
"""

from __future__ import annotations

import re

from orbitctl.doctor.groups import Group
from orbitctl.doctor.logscan import CONTEXT_LINES, Event
from orbitctl.doctor.signatures import (BY_ID, PINS, SIGILL_FIX, SIGILL_FIX_AMX, STACK_PACKAGES)

IDS = ("log.host.sigill", "log.pkg.mismatch", "log.cuda.toolkit", "log.flash.abi", "log.ext.abi")

# the library a SIGILL names: the kernel's trap line (also its continuation " in libx.so[...]"), gdb's "from /path/x.so"
_TRAP_LIB = re.compile(r"\bin (?P<lib>[\w.+-]{1,120})\[[0-9a-f]{1,16}\+")
_GDB_LIB = re.compile(r"\bfrom (?:\S{0,300}/)?(?P<lib>[\w.+-]{1,120}\.so(?:\.\d+)*)\s*$")
_SITE_FRAME = re.compile(r"File \"[^\"]{0,300}?[/\\](?:site|dist)-packages[/\\](?P<pkg>[A-Za-z_]\w{0,80})")
_TRACE_LINE = re.compile(r"^\s*(?P<mod>[A-Za-z_]\w{0,80})\.py\(\d+\):")  # python -m trace's "llama_cpp.py(475): ..."
_AMX = re.compile(r"amx|xtiledata|xtilecfg|tileloadconfig|_tile_", re.I)
_GGML = re.compile(r"ggml|llama", re.I)


def enrich(g: Group) -> None:
    {"log.host.sigill": _sigill, "log.pkg.mismatch": _packages, "log.cuda.toolkit": _toolkit,
     "log.flash.abi": _abi, "log.ext.abi": _abi}[g.id](g)


def _sigill(g: Group) -> None:
    lib = next((e.groups["lib"] for e in g.events if e.groups.get("lib")), None)
    for e in g.events:
        if lib is None:
            lib = _library_near(e)
    amx = (lib is not None and "amx" in lib.lower()) or any(_AMX.search(e.window or e.text) for e in g.events)
    where = f" in {lib}" if lib else ""
    if amx:
        g.title = (f"illegal instruction (SIGILL){where}: AMX tile instructions without the kernel's permission (the "
                   "process did not request XTILEDATA with arch_prctl), or on a CPU without AMX")
        g.fix = SIGILL_FIX_AMX
    else:
        g.title = (f"illegal instruction (SIGILL){where}: a native build for another CPU (compiled with -march=native / "
                   "GGML_NATIVE on a machine with AVX-512 or AMX, or a wheel pip's cache reused from another CPU)")
        g.fix = SIGILL_FIX if lib is None or _GGML.search(lib) else SIGILL_FIX.replace(
            "Rebuild the library", f"Rebuild {lib}", 1)
    g.data.update(library=lib, kind="amx" if amx else "native_build")
    if lib:
        g.evidence.append(f"library: {lib}")


def _library_near(e: Event) -> str | None:
    """The library or package a SIGILL line's neighbours name, if any."""
    text, lines = e.text, e.window.split("\n") if e.window else [e.text]
    at = min(CONTEXT_LINES["host.sigill"][0], e.line_no - 1) if e.window else 0  # the event's own line in its window
    for ln in lines[at:at + 6]:  # the trap's continuation line, gdb's frame after "received signal SIGILL"
        if m := _TRAP_LIB.search(ln) or _GDB_LIB.search(ln):
            return m["lib"]
    if "Fatal Python error" in text:  # faulthandler: the crashing thread's frames follow "Current thread"
        current = next((i for i, ln in enumerate(lines) if i > at and "Current thread" in ln), None)
        for ln in lines[current + 1:] if current is not None else []:
            if m := _SITE_FRAME.search(ln):
                return m["pkg"]
    for ln in reversed(lines[max(0, at - 3):at]):  # python -m trace printed the call that crashed
        if m := _TRACE_LINE.match(ln):
            return m["mod"]
    return None


def _top(name: str) -> str:
    return name.split(".")[0].replace("-", "_").lower()


def _packages(g: Group) -> None:
    e = g.events[0]
    m = e.groups
    if m.get("pkg"):
        target = _top(m["pkg"])
        importer = _importer(e.window, target)
        pair = [p for p in (importer, target) if p]
        g.title = (f"{importer} and {target} do not go together: {importer} imports {m['name']} from {m['pkg']}, which "
                   f"the installed {target} does not have") if importer else \
            (f"the installed {target} has no {m['name']}: the code importing it was written for another {target} "
             "version")
        g.data.update(name=m["name"], module=m["pkg"])
    elif m.get("req"):
        needed, found = _top(m["req"]), m["found"].rstrip(".")
        importer = _importer(e.window, needed) or "transformers"
        pair = [importer, needed]
        g.title = (f"{importer} and {needed} do not go together: {importer} needs {m['req']}{m['spec']}, the "
                   f"environment has {found}")
        g.data.update(required=f"{m['req']}{m['spec']}", found=found)
    else:
        a, aver, b, spec, have = (m.get("a") or m.get("a3"), m.get("aver") or m.get("aver3"), m.get("b") or m.get("b3"),
                                  m.get("bspec") or m.get("bspec3"), m.get("bver") or m.get("bver3"))
        pair = [_top(a), _top(b)]
        g.title = f"{a} and {b} do not go together: {a} {aver} requires {b}{spec}, the environment has {b} {have}"
        g.data.update(required=f"{b}{spec}", found=f"{b}=={have}")
    g.data["packages"] = pair
    g.fix = package_fix(pair)


def _importer(window: str, target: str) -> str | None:
    """The installed package whose frame, the last before the ImportError, is not ``target`` itself."""
    found = [_top(m["pkg"]) for m in _SITE_FRAME.finditer(window or "")]
    return next((p for p in reversed(found) if p != target), None)


def package_fix(packages: list[str]) -> str:
    """What to install for a pair of packages that do not go together, with orbitctl's pins where it has them."""
    pinned = [f"{p}{PINS[p]}" for p in packages if p in PINS]
    parts = []
    if pinned:
        parts.append("Install versions that go together, as orbitctl's pyproject.toml pins them: pip install "
                     + " ".join(f"'{x}'" for x in pinned) + " (into one environment), then `pip check`")
    if "vllm" in packages:
        parts.append("vLLM is not an orbitctl dependency and each vLLM wheel requires one exact torch (torch==): install "
                     "the vLLM release built for the installed torch (orbitctl's range: torch>=2.6,<=2.14.1), or run "
                     "the engine from its own environment")
    rest = [p for p in packages if p not in PINS and p != "vllm"]
    if rest:
        parts.append(f"{' and '.join(rest)}: install the release made for the other package's installed version")
    parts.append("orbitctl's whole set: pip install -e '.[bench]' from its checkout into a fresh environment (torch, "
                 "transformers>=5.20,<6, peft>=0.21,<0.22, trl>=1.16,<2)")
    return "; ".join(parts)


_TORCH_CUDA = re.compile(r"PyTorch \((?P<v>[\d.]{1,12})\)|Pytorch binaries were compiled with Cuda (?P<v2>[\d.]{1,12})")
_NVCC = re.compile(r"Cuda compilation tools, release (?P<v>[\d.]{1,12})")


def _toolkit(g: Group) -> None:
    nvcc = torch = None
    for e in g.events:
        nvcc = nvcc or e.groups.get("nvcc") or e.groups.get("nvcc2")
        torch = torch or e.groups.get("torch") or e.groups.get("torch2")
        if torch is None and (m := _TORCH_CUDA.search(e.window or "")):
            torch = m["v"] or m["v2"]
        if nvcc is None and (m := _NVCC.search(e.window or "")):
            nvcc = m["v"]
    g.data.update(nvcc=nvcc, torch_cuda=torch)
    if nvcc and torch:
        g.title = (f"the CUDA toolkit that builds the extension (nvcc {nvcc}) differs from the CUDA torch was built "
                   f"with ({torch})")
        g.fix = (f"Build with CUDA {torch}, the one torch was built with: point CUDA_HOME (and PATH) at it, e.g. "
                 f"CUDA_HOME=/usr/local/cuda-{torch}; or install the torch wheel for the installed toolkit: pip install "
                 f"torch --index-url https://download.pytorch.org/whl/cu{nvcc.replace('.', '')[:3]} (orbitctl's range "
                 "is torch>=2.6,<=2.14.1); prebuilt wheels need no nvcc (DeepSpeed: DS_BUILD_OPS=0 builds its ops at "
                 "first use). A driver older than torch's CUDA is log.cuda.drv")
        g.evidence.append(f"nvcc {nvcc}, torch.version.cuda {torch}")


def _abi(g: Group) -> None:
    e = next((x for x in g.events if x.groups.get("lib")), g.events[0])
    lib, sym = e.groups.get("lib"), e.groups.get("sym", "")
    torch_symbol = bool(re.match(r"_ZNK?(?:3c10|2at|5torch)", sym))
    g.data.update(library=lib, symbol=sym, torch_symbol=torch_symbol)
    shown = sym if len(sym) <= 80 else sym[:77] + "..."
    if g.id == "log.flash.abi":
        g.title = (f"flash-attn ({lib}) was built against another torch (or C++ ABI) than the one installed: undefined "
                   f"symbol {shown}")
    else:
        g.title = f"{lib} was built against another torch than the one installed: undefined torch symbol {shown}"
        site = re.search(r"(?:site|dist)-packages[/\\](?P<pkg>[A-Za-z_]\w{0,80})[/\\]", e.text)
        g.fix = BY_ID["ext.abi"].fix.replace("<package>", site["pkg"] if site else _package_of(lib))


def _package_of(lib: str | None) -> str:
    name = (lib or "").split(".")[0].lstrip("_").lower()
    return next((p for p in STACK_PACKAGES if name.startswith(p)), "<package>")


# what a process does while it loads a checkpoint (transformers, llama.cpp, DeepSpeed, torch, orbitctl)
LOAD_CONTEXT = re.compile(r"Loading checkpoint shards|[Ll]oading (?:a )?checkpoint|load_checkpoint|[Ll]oading weights|"
                          r"from_pretrained|load_state_dict|safe_open|llm_load_tensors|[Ll]oading (?:the )?model\b|"
                          r"load_frozen_base|[Ll]oading frozen base")
_DMESG_KILL = re.compile(r"Killed process (?P<pid>\d+) \((?P<comm>[^)]{1,40})\)(?:,? total-vm:(?P<vm>\d+)kB, "
                         r"anon-rss:(?P<rss>\d+)kB)?")
CKPT_HOST_OOM_TITLE = "host RAM exhausted while loading the checkpoint: the kernel's OOM killer sent SIGKILL (exit code -9)"
CKPT_HOST_OOM_FIX = ("Loading needs less host RAM than this node had: `orbitctl plan PROFILE` prints host RAM per node "
                     "against hardware.host_ram_gib (set it to the node's real RAM). orbitctl loads the frozen base "
                     "tensor by tensor straight to its device (the plan's load_path: 4 bytes x the largest layer), and "
                     "with expert parallelism each rank reads only its own experts (a larger memory.expert_parallel "
                     "lowers every rank's share); a whole shard or state dict in host RAM comes from other code "
                     "(from_pretrained without device_map / low_cpu_mem_usage, torch.load of a full state dict): load "
                     "with device_map, or quantize the base first (orbitctl quantize). Otherwise fewer ranks loading at "
                     "once per node, memory.offload_*: none while loading, or more RAM/swap; `dmesg | grep -i 'killed "
                     "process'` confirms the kill and the process's RSS")


def host_oom(g: Group) -> None:
    """The kernel's OOM kill: the process it names, and whether a checkpoint was loading (Ray's own kills excepted)."""
    for e in g.events:
        if m := _DMESG_KILL.search(e.text):
            g.data["killed"] = {"pid": int(m["pid"]), "comm": m["comm"],
                                "anon_rss_bytes": int(m["rss"]) * 1024 if m["rss"] else None}
            rss = f", anon-rss {int(m['rss']) / 1024 ** 2:.1f} GiB" if m["rss"] else ""
            g.evidence.append(f"the kernel killed pid {m['pid']} ({m['comm']}){rss}")
            break
    if g.data.get("ray_memory_monitor"):
        return
    kill = next((e for e in g.events if e.sig is not None and e.sig.id == "host.oom"), None)
    lines = (kill.window or kill.text).split("\n") if kill else []
    context = next((ln.strip() for ln in reversed(lines) if LOAD_CONTEXT.search(ln)), None)
    if context is None:
        return
    g.title, g.fix = CKPT_HOST_OOM_TITLE, f"{CKPT_HOST_OOM_FIX}. {g.fix}"
    g.data["during"] = "checkpoint_load"
    g.evidence.append(f"while loading the checkpoint: {context[:200]}")
