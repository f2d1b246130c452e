"""The benchmark harness: interleaving, the noise guard, paired ratios, case discovery, the
RESULTS.md generator (quick mode on a tiny subset) and the page-cache helpers for cold reads."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from benchmarks.__main__ import available, case_options, main
from benchmarks.common import (
    BenchArgs,
    NoiseGuard,
    Row,
    compare,
    cpu_model,
    evict,
    interleave,
    resident_fraction,
    row_from,
)
from benchmarks.report import render


def _logger(log: list[str], name: str):
    def fn() -> float:
        log.append(name)
        return 1.0

    return fn


def test_interleave_alternates_and_rotates_after_warmup():
    log: list[str] = []
    t = interleave({k: _logger(log, k) for k in "ABC"}, rounds=3, warmup=1)
    assert log == list("ABC" + "ABC" + "BCA" + "CAB")
    assert all(t[k].samples == [1.0, 1.0, 1.0] for k in "ABC")  # a returned number is the sample
    log.clear()
    interleave({k: _logger(log, k) for k in "AB"}, rounds=2, warmup=0, rotate=False)
    assert log == list("ABAB")


def test_interleave_sample_is_wall_time_unless_a_number_is_returned():
    t = interleave({"none": lambda: None, "dict": lambda: {"x": 3}}, rounds=2, warmup=0)
    assert all(0 <= s < 1 for s in t["none"].samples)
    assert t["dict"].values("x") == [3.0, 3.0] and t["dict"].samples[0] < 1


class _Clock:
    """Calibration times handed out in order: 5 warm-up calibrations, then two per sample."""

    def __init__(self, times: list[float]) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def test_noise_guard_retakes_a_sample_taken_while_the_host_was_slow():
    # warm-up: reference 1.0; sample 1 quiet; sample 2 slow after (1.5 > 1.25) -> re-taken; quiet
    clock = _Clock([1.0] * 5 + [1.0, 1.1] + [1.0, 1.5] + [1.1, 1.0])
    guard = NoiseGuard(tol=0.25, max_retakes=3, calibrate=clock)
    calls: list[int] = []
    t = interleave({"a": lambda: calls.append(1) or float(len(calls))}, 2, 0, guard)
    assert t["a"].samples == [1.0, 3.0]  # the slow sample (2.0) was replaced by its re-take
    assert (t["a"].retaken, t["a"].noisy) == (1, 0) and t["a"].guarded
    assert clock.times == []


def test_noise_guard_keeps_and_counts_a_sample_that_stays_slow():
    clock = _Clock([1.0] * 5 + [2.0, 2.0] * 3)
    guard = NoiseGuard(tol=0.25, max_retakes=2, calibrate=clock)
    t = interleave({"a": lambda: 7.0}, 1, 0, guard)
    assert t["a"].samples == [7.0]
    assert (t["a"].retaken, t["a"].noisy) == (2, 1)


def test_noise_guard_off_with_zero_tolerance():
    guard = NoiseGuard(
        tol=0.0, max_retakes=3, calibrate=lambda: pytest.fail("calibrated with the guard off")
    )
    t = interleave({"a": lambda: 1.0}, 3, 0, guard)
    assert t["a"].samples == [1.0, 1.0, 1.0] and t["a"].retaken == 0 and not t["a"].guarded


def test_compare_gives_paired_ratio_range_only_within_one_interleaved_group():
    t = interleave({"ours": iter([1.0, 2.0, 1.0]).__next__, "base": iter([4.0, 4.0, 5.0]).__next__},
                   3, 0, rotate=False)  # fmt: skip
    rows = [
        row_from("ours", t["ours"], "ms", group="g"),
        row_from("base", t["base"], "ms", group="g"),
    ]
    r = compare(rows, "ours", "base")
    assert r.ratio == pytest.approx(4.0)  # medians 1 and 4
    assert r.ratio_range == pytest.approx((2.0, 5.0))  # per round: 4, 2, 5
    other = Row("other", 2.0, "ms", higher_is_better=False, samples=[2.0, 2.0, 2.0])
    rows.append(other)
    assert compare(rows, "other", "base").ratio_range is None  # not from the same rounds


def test_case_discovery_is_generic():
    names = available()
    for n in ("vl_preprocess", "vl_dataset", "text_loaders", "staging", "streaming", "packing",
              "bpe", "vl_build_workers"):  # fmt: skip
        assert n in names
    assert not {"common", "report", "_vl_open", "text_corpus", "__main__"} & set(names)


def test_set_options_can_be_scoped_to_one_case():
    cases = ["bpe", "staging"]
    sets = ["mb=1", "bpe.vocab=300", "staging.batches=8", "other.key=1"]
    assert case_options(sets, "bpe", cases) == {"mb": "1", "vocab": "300", "other.key": "1"}
    assert case_options(sets, "staging", cases) == {"mb": "1", "batches": "8", "other.key": "1"}


def _doc(rows: list[Row], **kw) -> dict:
    from dataclasses import asdict

    doc = {
        "benchmark": "demo",
        "time": "2026-11-22T10:00:00Z",
        "duration_s": 1.5,
        "machine": {"cpu": "Test CPU 9000", "cores": 2, "usable_cores": 2, "memory_gib": 23.0,
                    "platform": "Linux", "versions": {"python": "3.11.0", "torch": "2.13.0"}},
        "git": {"commit": "abc1234567", "dirty": True},
        "command": "python -m benchmarks demo --repeats 3",
        "note": "machine shared with other jobs",
        "loadavg": {"before": [1.0, 1.0, 1.0], "after": [2.0, 2.0, 2.0]},
        "args": {"quick": False, "noise_tol": 0.25, "max_retakes": 3},
        "rows": [asdict(r) for r in rows],
    }  # fmt: skip
    return doc | kw


def test_render_names_machine_date_commit_command_and_ratios():
    ours = Row("ours", 1.0, "ms", higher_is_better=False, samples=[0.9, 1.0, 1.2], group="g",
               retaken=2, noisy=1, note="like for like")  # fmt: skip
    base = Row("base | HF", 4.0, "ms", higher_is_better=False, samples=[3.0, 4.0, 5.0], group="g")
    skipped = Row("fast processor", float("nan"), "ms", note="not measured: no torchvision")
    quiet = Row("quiet", 1.0, "ms", samples=[1.0, 1.0], guarded=True)
    unguarded = Row("unguarded", 1.0, "ms", samples=[1.0, 1.0, 1.0, 1.0])
    compare([ours, base], "ours", "base | HF")
    text = render({"demo": _doc([ours, base, skipped, quiet, unguarded])})
    assert "| 2 (0/0) |" in text and "| 4 |" in text  # counts only where the guard ran
    assert "GENERATED" in text
    assert "Test CPU 9000, 2 cores, 23.0 GiB" in text
    assert "2026-11-22T10:00:00Z" in text and "`abc1234567 + uncommitted changes`" in text
    assert "`python -m benchmarks demo --repeats 3`" in text
    assert "machine shared with other jobs" in text
    assert "| ours | 1 | 0.9-1.2 | ms | 4.00x (3.33-4.17) | base \\| HF |" in text
    assert "| 3 (2/1) | like for like |" in text
    assert "| fast processor | n/a |" in text and "not measured: no torchvision" in text


def test_render_appends_the_history_one_level_down():
    from benchmarks.report import HISTORY

    text = render({})
    assert "\n## History\n" in text
    headings = [x for x in HISTORY.read_text().splitlines() if x.startswith("#")]
    assert headings
    for h in headings:  # same text (same anchor), one level down
        assert f"\n#{h}\n" in text and f"\n{h}\n" not in text


def test_rerunning_some_cases_keeps_the_other_sections_verbatim(tmp_path):
    """The JSON files are local (not committed): regenerating RESULTS.md after running only some
    cases keeps every other case's section as it was, in the cases' order."""
    from benchmarks.report import write_results

    row = Row("ours", 1.0, "ms", samples=[1.0, 1.0])
    res, out = tmp_path / "RESULTS.md", tmp_path / "json"
    out.mkdir()
    for name in ("alpha", "beta"):
        (out / f"{name}.json").write_text(json.dumps(_doc([row], time=f"2026-01-0{len(name)}")))
    write_results(res, out, ["alpha", "beta", "gamma"], quick=False)
    first = res.read_text()
    beta_before = first[first.index("## beta") : first.index("## History")]
    (out / "beta.json").unlink()
    (out / "alpha.json").write_text(json.dumps(_doc([row], time="2026-02-02T00:00:00Z")))
    write_results(res, out, ["alpha", "beta", "gamma"], quick=False)
    text = res.read_text()
    assert "2026-02-02T00:00:00Z" in text  # alpha re-rendered
    assert beta_before in text  # beta carried over verbatim
    assert text.index("## alpha") < text.index("## beta") < text.index("## History")
    assert "[alpha](#alpha), [beta](#beta)." in text and "gamma" not in text


def test_the_gpu_runs_rows_get_a_section_that_later_renders_keep(tmp_path):
    """scripts/gpu_check.py writes gpu_check.json beside the cases' JSON: its rows become a
    section naming the device and software, carried over when only the cases are re-run (CI
    machines have no GPU), and the notes of carried sections stay in the head."""
    from benchmarks.report import write_results

    res, out = tmp_path / "RESULTS.md", tmp_path / "json"
    out.mkdir()
    (out / "alpha.json").write_text(json.dumps(_doc([Row("ours", 1.0, "ms")], note="quiet host")))
    gpu = {"device": "NVIDIA H200", "torch": "2.13.0", "transformers": "5.23.0",
           "date": "2026-11-26", "commit": "abc", "results": [
               {"check": "tiny compiled", "ok": True, "value": "max rel diff 2e-06", "note": ""},
               {"check": "VL staged / resident", "ok": False, "value": "1.039x", "note": ""},
               {"check": "2B eager", "ok": None, "value": "370 ms/step", "note": ""}]}  # fmt: skip
    (out / "gpu_check.json").write_text(json.dumps(gpu))
    write_results(res, out, ["alpha"], quick=False)
    text = res.read_text()
    section = text[text.index("## gpu_check") : text.index("## History")]
    assert "NVIDIA H200; torch 2.13.0, transformers 5.23.0" in section
    assert "| tiny compiled | yes |" in section and "| VL staged / resident | **no** |" in section
    assert "| 2B eager | measured | 370 ms/step |" in section
    (out / "gpu_check.json").unlink()
    (out / "alpha.json").unlink()
    write_results(res, out, ["alpha"], quick=False)
    again = res.read_text()
    assert section in again  # carried over verbatim
    assert "**Note:** quiet host" in again[: again.index("## alpha")]  # the head keeps it


def test_results_generator_quick_on_a_tiny_subset(tmp_path, capsys):
    out, res = tmp_path / "json", tmp_path / "RESULTS.md"
    argv = ["--results", "--quick", "--repeats", "1", "--warmup", "0", "--out-dir", str(out),
            "--results-file", str(res), "--note", "test run", "--set", "bpe.mb=0.05",
            "--set", "bpe.vocab=300", "--set", "staging.batches=8", "bpe", "staging"]  # fmt: skip
    assert main(argv) == 0
    text = res.read_text()
    assert "## bpe" in text and "## staging" in text and "Quick mode" in text
    assert cpu_model() in text and "test run" in text
    assert (
        "`python -m benchmarks bpe --repeats 1 --warmup 0 --quick --set mb=0.05 --set vocab=300`"
        in text
    )
    doc = json.loads((out / "bpe_quick.json").read_text())
    assert doc["machine"]["cores"] == os.cpu_count() and "commit" in doc["git"]
    if (Path(__file__).parents[1] / ".git").exists():  # a git checkout (not an sdist)
        assert doc["git"]["commit"]
    assert all(not math.isnan(r["value"]) for r in doc["rows"])
    # render-only regenerates the same tables from the JSON alone
    res.unlink()
    assert main(["--results", "--render-only", "--quick", "--out-dir", str(out),
                 "--results-file", str(res)]) == 0  # fmt: skip
    assert "## bpe" in res.read_text() and "## staging" in res.read_text()


def test_a_case_that_raises_is_reported_and_fails_the_run(tmp_path, monkeypatch):
    import benchmarks.bpe as bpe

    def boom(args: BenchArgs):
        raise RuntimeError("broken on purpose")

    monkeypatch.setattr(bpe, "run", boom)
    out, res = tmp_path / "json", tmp_path / "R.md"
    rc = main(["--results", "--quick", "--out-dir", str(out), "--results-file", str(res), "bpe"])
    assert rc == 1
    assert "RuntimeError: broken on purpose" in res.read_text()


def _fs_type(path: Path) -> str:
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        parts = line.split()
        if str(path).startswith(parts[1]) and len(parts[1]) > len(best):
            best, kind = parts[1], parts[2]
    return kind


@pytest.mark.skipif(not Path("/proc/mounts").exists(), reason="Linux page-cache helpers")
def test_evict_drops_a_files_pages_from_the_page_cache(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(4 << 20))
    f.read_bytes()
    assert resident_fraction([f]) == 1.0
    evict([f])
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs pages are the file's storage: nothing to evict")
    assert resident_fraction([f]) < 0.1
    f.read_bytes()
    assert resident_fraction([f]) == 1.0
