"""The code sandbox: hostile completions are contained and score 0; honest ones score their pass fraction."""

import os
import sys

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the sandbox's rlimits and namespaces are Linux features", allow_module_level=True)

from orbitctl.rl.sandbox import SandboxLimits, run_tests

TESTS = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(2) == 3\n    assert candidate(3) == 4\n"
FAST = SandboxLimits(timeout_s=3.0, cpu_s=3)


def test_honest_completion_scores_pass_fraction():
    assert run_tests("def f(x):\n    return x + 1\n", TESTS, "f", FAST).fraction == 1.0
    partial = run_tests("def f(x):\n    return 2 if x == 1 else x\n", TESTS, "f", FAST)
    assert (partial.passed, partial.total) == (1, 3)


def test_top_level_asserts_without_check_function():
    result = run_tests("def g(x):\n    return x * 2\n", "assert g(2) == 4\nassert g(3) == 7\n", None, FAST)
    assert (result.passed, result.total) == (1, 2)


def test_infinite_loop_is_killed():
    result = run_tests("def f(x):\n    while True:\n        pass\n", TESTS, "f", FAST)
    # the wall-clock timeout or the CPU-seconds limit, whichever the machine's load makes first: both are a timeout
    assert result.status == "timeout" and result.fraction == 0.0


def test_a_loop_out_of_cpu_seconds_is_a_timeout_not_a_crash():
    # the wall clock is far off, so the CPU-seconds limit is what stops it
    result = run_tests("def f(x):\n    while True:\n        pass\n", TESTS, "f", SandboxLimits(timeout_s=60.0, cpu_s=1))
    assert result.status == "timeout" and result.fraction == 0.0


def test_a_program_that_kills_itself_is_a_crash():
    result = run_tests("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n", TESTS, "f", FAST)
    assert result.status == "crashed" and result.fraction == 0.0
    assert result.detail.startswith("the sandboxed program died with SIGKILL (killed): "), result.detail


def test_a_program_that_executes_an_illegal_instruction_is_a_crash_that_names_the_signal():
    """Native code gone wrong inside the sandbox (here: SIGILL) fails that one run with the signal and its cause."""
    result = run_tests("import os, signal\nos.kill(os.getpid(), signal.SIGILL)\n", TESTS, "f", FAST)
    assert result.status == "crashed" and result.fraction == 0.0
    assert result.detail.startswith("the sandboxed program died with SIGILL (illegal instruction): a native build for "
                                    "another CPU"), result.detail
    assert run_tests("def f(x):\n    return x + 1\n", TESTS, "f", FAST).fraction == 1.0  # and the next run is whole


def test_fork_bomb_is_contained():
    bomb = ("import os\nfor _ in range(10000):\n    try:\n        os.fork()\n    except OSError:\n        break\n"
            "def f(x):\n    return x + 1\n")
    before = len([p for p in os.listdir("/proc") if p.isdigit()])
    result = run_tests(bomb, TESTS, "f", FAST)
    after = len([p for p in os.listdir("/proc") if p.isdigit()])
    # the process limit stops the forks; the group kill reaps whatever was made
    assert after - before < 50
    assert result.fraction in (0.0, 1.0)
    if result.status == "ok":
        # forks were refused (OSError) long before 10,000: the limit held
        assert result.fraction == 1.0


def test_fork_bomb_that_keeps_trying_scores_zero():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\ndef f(x):\n    return x + 1\n"
    result = run_tests(bomb, TESTS, "f", FAST)
    assert result.fraction == 0.0


def test_huge_allocation_fails_inside_the_sandbox():
    code = "buf = bytearray(8 * 1024 ** 3)\ndef f(x):\n    return x + 1\n"
    assert run_tests(code, TESTS, "f", FAST).fraction == 0.0


def test_writing_outside_the_temp_dir_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    code = f"open({str(target)!r}, 'w').write('x')\ndef f(x):\n    return x + 1\n"
    assert run_tests(code, TESTS, "f", FAST).fraction == 0.0
    assert not target.exists()


def test_parent_environment_is_not_readable(monkeypatch):
    monkeypatch.setenv("ORBITCTL_TEST_SECRET", "hunter2")
    code = (
        "import os\n"
        "found = os.environ.get('ORBITCTL_TEST_SECRET') == 'hunter2'\n"
        "if not found:\n"
        "    try:\n"
        "        found = b'hunter2' in open(f'/proc/{os.getppid()}/environ', 'rb').read()\n"
        "    except OSError:\n"
        "        pass\n"
        "def f(x):\n    return x + 1 if found else None\n")
    assert run_tests(code, TESTS, "f", FAST).fraction == 0.0
    # the same program passes when the secret is handed to it, so the 0 above is containment
    leak = "found = True\ndef f(x):\n    return x + 1 if found else None\n"
    assert run_tests(leak, TESTS, "f", FAST).fraction == 1.0


def test_code_reward_scores_through_the_sandbox():
    from orbitctl.rl.rewards import make_reward
    from orbitctl.data.tasks import PromptItem

    item = PromptItem(prompt="def f(x):\n", tests=TESTS, entry_point="f")
    rewards = make_reward("code", None)(["    return x + 1\n", "    while True: pass\n"], [item, item])
    assert rewards == [1.0, 0.0]


def test_sandboxes_started_from_many_threads_all_finish():
    # the code reward runs sandboxes from a thread pool; confinement must not depend on the
    # parent being single-threaded (Python code between fork and exec could deadlock there)
    from concurrent.futures import ThreadPoolExecutor

    programs = ["def f(x):\n    return x + 1\n", "def f(x):\n    return 2 if x == 1 else x\n"] * 6
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(lambda p: run_tests(p, TESTS, "f", FAST), programs))
    assert [r.status for r in results] == ["ok"] * 12
    assert [r.passed for r in results] == [3, 1] * 6


def test_a_check_whose_asserts_sit_in_a_loop_passes_when_its_body_runs_to_the_end():
    # HumanEval/32, /38 and /50 check inside a for loop: nothing at the top of check() to count
    tests = "def check(candidate):\n    for x in range(5):\n        assert candidate(x) == x * 2\n"
    good = run_tests("def double(x):\n    return x * 2\n", tests, "double")
    bad = run_tests("def double(x):\n    return x + 2\n", tests, "double")
    assert (good.status, good.passed, good.total) == ("ok", 1, 1)
    assert (bad.status, bad.passed) == ("ok", 0)
