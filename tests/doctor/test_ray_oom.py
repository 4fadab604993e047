"""Ray's memory monitor, in each form Ray prints it, is host RAM (log.host.oom) with Ray's own fix, never GPU memory.

The fixtures follow the texts Ray prints: the worker's exit detail alone ("Memory on the node ... exceeds the
memory usage threshold of 0.95. Ray killed this worker ..."), the driver's ``ray.exceptions.OutOfMemoryError``
traceback around it, and the raylet's periodic summary ("N Workers (tasks / actors) killed due to memory
pressure (OOM)").
"""

import json
from pathlib import Path

import pytest

from orbitctl.cli.app import main
from orbitctl.doctor import FAIL, triage_log

LOGS = Path(__file__).parent / "fixtures" / "logs"
FORMS = ["ray_oom_worker", "ray_oom_driver", "ray_oom_raylet"]


@pytest.mark.parametrize("name", FORMS)
def test_each_memory_monitor_form_is_host_oom_with_rays_fix(name):
    root = triage_log((LOGS / f"{name}.log").read_text()).root_cause
    assert root is not None and root.id == "log.host.oom" and root.status == FAIL
    assert "Ray's memory monitor" in root.title and root.data["ray_memory_monitor"] is True
    for remedy in ("RAY_memory_usage_threshold", "fewer Ray workers", "more RAM", "memory.offload_optimizer"):
        assert remedy in root.fix, remedy
    assert "CUDA" not in root.title and "GPU out of memory" not in root.title


@pytest.mark.parametrize("name, used, fraction", [("ray_oom_worker", "1905.44GB", 0.951009),
                                                  ("ray_oom_driver", "1921.07GB", 0.958809)])
def test_the_node_memory_and_threshold_are_read(name, used, fraction):
    root = triage_log((LOGS / f"{name}.log").read_text()).root_cause
    assert root.data["ray_node_memory"] == {
        "used": used, "total": "2003.60GB", "fraction": fraction, "threshold": 0.95}
    assert any("over Ray's threshold 0.95" in line for line in root.evidence)


def test_the_driver_wrapper_is_not_read_as_gpu_memory():
    # ``OutOfMemoryError`` alone is the GPU allocator's signature; Ray's wrapper supersedes it on the same line
    text = "ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory."
    result = triage_log(text)
    assert result.root_cause.id == "log.host.oom"
    assert not any(f.id.startswith("log.oom") for f in result.findings)


def test_a_worker_death_after_the_kill_is_its_consequence():
    text = ((LOGS / "ray_oom_raylet.log").read_text() +
            "(raylet) A worker died or was killed while executing a task by an unexpected system error. To "
            "troubleshoot the problem, check the logs for the dead worker.\n")
    by_id = {f.id: f for f in triage_log(text).findings}
    assert triage_log(text).root_cause.id == "log.host.oom"
    assert "log.ray.died" not in by_id or by_id["log.ray.died"].status != FAIL


@pytest.mark.parametrize("name", FORMS)
def test_doctor_log_names_host_oom(name, capsys):
    assert main(["doctor", "--log", str(LOGS / f"{name}.log"), "--no-machine", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["root_cause"]["id"] == "log.host.oom"
    assert "RAY_memory_usage_threshold" in report["root_cause"]["fix"]
