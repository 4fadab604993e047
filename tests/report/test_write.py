"""The report directory: valid PNGs, summary.json and summary.md, overlays of several runs, all-or-nothing."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from orbitctl.report import write_report
from orbitctl.report.figures import FIGURES, draw_entropy, draw_memory, draw_mismatch, draw_reward
from orbitctl.report.runs import load_runs


def _texts(fig) -> list[str]:
    """Every legend entry and panel text of a figure."""
    found = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            found += [t.get_text() for t in legend.get_texts()]
        found += [t.get_text() for t in ax.texts]
    return found


def test_one_run_writes_pngs_and_summaries_into_its_report_dir(make_run):
    run = make_run("tiny")
    messages = []
    report = write_report([run], on_progress=messages.append)
    assert report.out == run / "report"
    names = [name for name, _, _ in FIGURES]
    assert report.files == names + ["summary.json", "summary.md"]
    assert sorted(p.name for p in report.out.iterdir()) == sorted(report.files)
    for name in names:
        with Image.open(report.out / name) as image:
            assert image.format == "PNG"
            width, height = image.size
            image.verify()
        assert width >= 800 and height >= 350, (name, image.size)
    document = json.loads((report.out / "summary.json").read_text())
    assert document["format"] == "orbitctl-report" and document["figures"] == names
    assert [r["name"] for r in document["runs"]] == ["tiny"]
    page = (report.out / "summary.md").read_text()
    assert "## tiny" in page and all(f"]({name})" in page for name in names)
    assert "**unstable**" in page and "left the band at step 25" in page
    assert [m for m in messages if m.startswith("drawing ")] == [f"drawing {n} ({c})" for n, c, _ in FIGURES]


def test_two_runs_overlay_in_the_same_figures(make_run, tmp_path):
    runs = load_runs([make_run("single-node"), make_run("multi-node")])
    for draw in (draw_reward, draw_entropy, draw_mismatch, draw_memory):
        texts = " ".join(_texts(draw(runs)))
        assert "single-node" in texts and "multi-node" in texts, draw.__name__
    report = write_report([tmp_path / "single-node", tmp_path / "multi-node"], out=tmp_path / "compare")
    document = json.loads((tmp_path / "compare" / "summary.json").read_text())
    assert [r["name"] for r in document["runs"]] == ["single-node", "multi-node"]
    assert report.out == tmp_path / "compare"


def test_runs_with_the_same_directory_name_are_told_apart(tmp_path, make_run):
    runs = load_runs([make_run("node-a/run"), make_run("node-b/run")])
    assert [r.label for r in runs] == ["node-a/run", "node-b/run"]


def test_series_a_run_did_not_log_say_not_logged(make_run):
    keep = ("step", "reward_mean", "reward_std", "accuracy", "entropy")
    records = [{k: v for k, v in planted.items() if k in keep}
               for planted in (dict(step=s, reward_mean=0.5, reward_std=0.1, accuracy=0.5, entropy=1.0)
                               for s in range(1, 6))]
    runs = load_runs([make_run("bare", records)])
    assert any("not logged" in t for t in _texts(draw_memory(runs)))
    assert any("not logged" in t for t in _texts(draw_mismatch(runs)))
    assert not any("not logged" in t for t in _texts(draw_reward(runs)))
    report = write_report([runs[0].root])
    assert json.loads((report.out / "summary.json").read_text())["runs"][0]["memory"]["phases"] == {}


def test_all_zero_mismatch_is_said_not_hidden(make_run, planted):
    records = [{**planted.record(s), "mismatch_k3_kl": 0.0, "mismatch_logp_abs_mean": 0.0} for s in range(1, 11)]
    fig = draw_mismatch(load_runs([make_run("exact", records)]))
    assert sum("0 at every step" in t for t in _texts(fig)) == 2
    assert all(ax.get_yscale() == "linear" for ax in fig.axes)
    fig = draw_mismatch(load_runs([make_run("drift")]))
    assert all(ax.get_yscale() == "log" for ax in fig.axes)


class Interrupted(Exception):
    pass


def test_an_interrupted_report_leaves_the_previous_one_or_none(make_run, monkeypatch, planted):
    import orbitctl.report.api as api

    run = make_run("cut")
    real_save = api.save
    calls = {"n": 0}

    def save_then_die(fig, path):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Interrupted("killed while drawing")
        real_save(fig, path)

    monkeypatch.setattr(api, "save", save_then_die)
    with pytest.raises(Interrupted):
        write_report([run])
    assert not (run / "report").exists()
    assert [p.name for p in run.iterdir() if p.name.startswith(".")] == []  # no temporary directory left
    monkeypatch.setattr(api, "save", real_save)
    write_report([run])
    before = {p.name: p.read_bytes() for p in (run / "report").iterdir()}
    shorter = [planted.record(s) for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shorter))
    calls["n"] = 0
    monkeypatch.setattr(api, "save", save_then_die)
    with pytest.raises(Interrupted):
        write_report([run])
    assert {p.name: p.read_bytes() for p in (run / "report").iterdir()} == before
    monkeypatch.setattr(api, "save", real_save)
    write_report([run])  # a complete rerun replaces the old report
    assert json.loads((run / "report" / "summary.json").read_text())["runs"][0]["steps"]["logged"] == 5



def test_an_episode_run_gets_the_completion_and_tool_call_figure(make_run, planted):
    from orbitctl.report.figures import draw_episodes

    records = [{**planted.record(s), "tool_call_valid_rate": 0.5 + s / 100,
                **({"eval_tool_call_valid_rate": 0.7} if s % 10 == 0 else {})} for s in range(1, planted.STEPS + 1)]
    run = make_run("agent", records, **{"data.train": "env:guess", "rollout.max_turns": 4})
    report = write_report([run])
    assert report.files[len(FIGURES)] == "episodes.png" and (report.out / "episodes.png").is_file()
    texts = " ".join(_texts(draw_episodes(load_runs([run]))))
    assert "agent: held-out greedy" in texts and "agent: rollouts" in texts and "not logged" not in texts
    plain = write_report([make_run("prompts")])  # a run on prompts: no episode figure
    assert "episodes.png" not in plain.files
