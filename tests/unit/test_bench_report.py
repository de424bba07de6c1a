"""Benchmark reports from synthetic runs: JSON round trip, markdown, comparison ratios, plots;
and the workloads (named files, traces, prompts of the asked length)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bench.compare import compare, fidelity, format_comparisons, format_fidelity
from bench.record import RequestRecord, ServerTimings, prefill_path_of
from bench.report import Report, Run, markdown
from bench.runner import Arrival
from bench.stats import SLO
from bench.workload import build_requests
from deploy.workload import Workload, load_workload, read_trace, workload_names

SLO_ = SLO(ttft_s=1.0, tpot_s=0.1)


def synthetic_run(system: str, arrival: Arrival, ttft: float, tpot: float, n: int = 10) -> Run:
    records = []
    for i in range(n):
        sent = i * 0.5
        chunks = [(sent + ttft, 1)] + [(sent + ttft + tpot * k, 1) for k in range(1, 8)]
        server = ServerTimings(0.001, ttft * 0.8, 0.005, ttft * 0.9, ttft * 0.95, ttft + 7 * tpot)
        records.append(RequestRecord(i, 64, 8, sent, chunks, None, server))
    return Run(system, "chat", arrival, records, SLO_, 2.0)


def make_report() -> Report:
    runs = []
    for system, ttft, tpot in (
        ("disaggregated", 0.3, 0.05),
        ("colocated", 0.25, 0.06),
        ("engine", 0.2, 0.04),
    ):
        runs.append(synthetic_run(system, Arrival("closed", 1), ttft, tpot))
        # Latency grows with rate; each system breaks the TTFT SLO at a different rate.
        for rate, factor in ((0.5, 1.0), (1.0, 2.0), (2.0, 4.0)):
            breaks = {"disaggregated": 1.0, "colocated": 2.0, "engine": 4.0}[system]
            runs.append(
                synthetic_run(system, Arrival("poisson", rate), ttft * factor * breaks, tpot)
            )
    return Report({"model": "synthetic"}, runs, attainment_target=0.9)


def test_json_round_trip_keeps_records_and_summaries(tmp_path: Path) -> None:
    report = make_report()
    report.save(tmp_path / "report.json")
    body = json.loads((tmp_path / "report.json").read_text())
    assert body["runs"][0]["summary"]["ttft"]["p50"] == pytest.approx(0.3)
    loaded = Report.load(tmp_path / "report.json")
    assert [r.system for r in loaded.runs] == [r.system for r in report.runs]
    assert loaded.runs[3].summary == report.runs[3].summary
    assert loaded.runs[0].records[0].server == report.runs[0].records[0].server


def test_max_rate_meeting_slo_per_system() -> None:
    report = make_report()
    # disaggregated TTFT at 0.5/1/2 req/s: 0.3, 0.6, 1.2 s -> meets 1 s up to 1.0
    assert report.max_rate_meeting_slo("chat", "disaggregated") == 1.0
    # colocated: 0.5, 1.0, 2.0 -> 1.0 (1.0 <= 1.0 s)
    assert report.max_rate_meeting_slo("chat", "colocated") == 1.0
    # engine: 0.8, 1.6, ... -> 0.5
    assert report.max_rate_meeting_slo("chat", "engine") == 0.5


def test_compare_ratios() -> None:
    (chat,) = compare(make_report())
    assert chat.low_load == "1 in flight"
    by_what = {r.what: r for r in chat.ratios}
    ttft = by_what["TTFT P50 disaggregated / engine"]
    assert (ttft.ours, ttft.baseline, ttft.ratio) == pytest.approx((0.3, 0.2, 1.5))
    tpot = by_what["TPOT P95 disaggregated / engine"]
    assert tpot.ratio == pytest.approx(0.05 / 0.04)
    goodput = by_what["goodput (max req/s meeting the SLO) disaggregated / colocated"]
    assert goodput.ratio == pytest.approx(1.0)
    text = format_comparisons([chat])
    assert "TTFT P50 disaggregated / engine: 300 ms vs 200 ms = 1.50x" in text


def test_fidelity_pairs_the_load_points_both_ran_and_bounds_each_quantile() -> None:
    real = synthetic_run("disaggregated", Arrival("poisson", 1.0), ttft=0.5, tpot=0.1)
    # TTFT 8% faster (P50 within 10%), TPOT 25% slower (out of both bounds).
    sim = synthetic_run("sim", Arrival("poisson", 1.0), ttft=0.46, tpot=0.125)
    alone = synthetic_run("sim", Arrival("poisson", 2.0), ttft=0.46, tpot=0.125)
    report = Report({"model": "synthetic"}, [real, sim, alone])
    rows = fidelity(report)
    assert [(r.load, r.metric, r.quantile) for r in rows] == [
        ("1 req/s", "TTFT", "p50"),
        ("1 req/s", "TTFT", "p95"),
        ("1 req/s", "TPOT", "p50"),
        ("1 req/s", "TPOT", "p95"),
    ]  # the 2 req/s run has no real peer
    ttft_p50, _, tpot_p50, tpot_p95 = rows
    assert ttft_p50.error == pytest.approx(-0.08) and ttft_p50.within
    assert tpot_p50.error == pytest.approx(0.25) and not tpot_p50.within
    assert not tpot_p95.within
    text = format_fidelity(rows)
    assert "| chat | 1 req/s | 500 / 460 (-8%) |" in text
    assert "(+25%, out)" in text
    assert "2 of 4 quantiles within bounds" in text


def test_bench_fidelity_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve_cli import main

    make_report().save(tmp_path / "report.json")
    args = ["bench", "fidelity", str(tmp_path / "report.json")]
    assert main([*args, "--sim", "colocated"]) == 0
    # colocated's TTFT is 0.25/0.3 of disaggregated's at 1 in flight: 17% fast.
    assert "| chat | 1 in flight | 300 / 250 (-17%, out)" in capsys.readouterr().out
    assert main([*args, "--sim", "nothing"]) == 1  # no load point in common


def test_judging_only_the_short_prompts_of_a_mixed_run() -> None:
    run = synthetic_run("adaptive", Arrival("poisson", 1.0), ttft=0.2, tpot=0.05)
    for record in run.records[:3]:
        record.prompt_tokens = 1500
        record.chunks = [(t, n) for t, n in record.chunks[:1]] + [
            (record.chunks[0][0] + 0.4 * k, 1) for k in range(1, 8)
        ]  # these decode at 400 ms a token
    report = Report({"model": "synthetic"}, [run])
    assert report.runs[0].summary.tpot is not None
    assert report.runs[0].summary.tpot.p95 == pytest.approx(0.4)
    short = report.with_prompts_up_to(192)
    assert [len(r.records) for r in short.runs] == [7]
    assert short.runs[0].summary.tpot is not None
    assert short.runs[0].summary.tpot.p95 == pytest.approx(0.05)
    assert report.with_prompts_up_to(10).runs == []  # a run with nothing left is dropped


def test_markdown_has_a_row_per_run_and_the_hops() -> None:
    text = markdown(make_report())
    rows = [line for line in text.splitlines() if line.startswith("| disaggregated | 0.5 req/s")]
    assert len(rows) == 2  # the latency table and the per-hop table
    assert "| 10/10 |" in rows[0] and "| 100% |" in rows[0]
    # Per hop: client TTFT 300 ms, server TTFT 270 ms -> 30 ms outside the router.
    assert rows[1].split("|")[4:8] == [" 240 ", " 270 ", " 300 ", " 30 "]
    assert "disaggregated 1 req/s, colocated 1 req/s, engine 0.5 req/s" in text


def test_the_report_shows_each_systems_role_flip_time(tmp_path: Path) -> None:
    flips = {"n": 10, "p50_s": 0.112, "p95_s": 0.2, "max_s": 0.25, "num_routers": 2}
    meta = {"model": "synthetic", "facts": {"adaptive": {"role_flips": flips}}}
    report = Report(meta, [synthetic_run("adaptive", Arrival("poisson", 1.0), 0.3, 0.05, n=2)])
    assert "| adaptive | 10 | 112 | 200 | 250 | 2 |" in markdown(report).splitlines()
    report.save(tmp_path / "report.json")
    assert "| adaptive | 10 | 112 |" in markdown(Report.load(tmp_path / "report.json"))
    assert "Role flips" not in markdown(Report({"facts": {"colocated": {}}}, report.runs))


def _hops_row(run: Run) -> str:
    """The run's row in the per-hop table (its second row in the markdown)."""
    rows = markdown(Report({"model": "synthetic"}, [run])).splitlines()
    (row,) = [line for line in rows if line.startswith(f"| {run.system} |")][1:]
    return row


def test_the_hops_table_counts_where_prompts_were_prefilled() -> None:
    run = synthetic_run("adaptive", Arrival("poisson", 1.0), 0.3, 0.05, n=5)
    for record, path in zip(run.records, ["local", "remote", "local", "local", ""], strict=True):
        assert record.server is not None
        record.server = dataclasses.replace(record.server, prefill_path=path)
    assert _hops_row(run).split("|")[-2] == " 3:1 "
    colocated = synthetic_run("colocated", Arrival("poisson", 1.0), 0.3, 0.05, n=2)
    assert _hops_row(colocated).split("|")[-2] == " - "


@pytest.mark.parametrize(
    ("prefill_replica", "decode_replica", "path"),
    [("decode-ab12", "decode-ab12", "local"), ("prefill-cd34", "decode-ab12", "remote"),
     # A decode replica flipped to prefill, prefilling for another: remote.
     ("decode-ef56", "decode-ab12", "remote"), ("engine-ef56", "", "")],
)  # fmt: skip
def test_prefill_path_from_the_servers_replica_ids(
    prefill_replica: str, decode_replica: str, path: str
) -> None:
    assert prefill_path_of(prefill_replica, decode_replica) == path


def test_records_saved_before_the_prefill_path_still_load() -> None:
    saved = synthetic_run("disaggregated", Arrival("closed", 1), 0.3, 0.05, n=1).records[0]
    data = saved.to_json()
    assert data["server"].pop("prefill_path") == ""
    loaded = RequestRecord.from_json(data)
    assert loaded.server is not None and loaded.server.prefill_path == ""


def test_plots_are_written(tmp_path: Path) -> None:
    from bench.plots import plot_report

    paths = plot_report(make_report(), tmp_path)
    assert [p.name for p in paths] == ["chat-cdf.png", "chat-vs-rate.png"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_named_workloads_load() -> None:
    assert workload_names() == [
        "chat", "chat-burst", "gpu-chat", "gpu-long", "gpu-mixed", "gpu-mixed-itl", "long-prompt",
        "shared-prefix",
    ]  # fmt: skip
    # gpu-mixed-itl is gpu-mixed's trace with an ITL bound; the others set none.
    assert load_workload("gpu-mixed-itl").slo.itl_s == 0.05
    assert load_workload("gpu-mixed-itl").lengths(400, 0) == load_workload("gpu-mixed").lengths(
        400, 0
    )
    assert load_workload("gpu-mixed").slo.itl_s is None
    burst = load_workload("chat-burst").lengths(46, seed=0)
    # 20 chat, 6 long prompts together, 20 chat.
    assert [p > 192 for p, _ in burst] == [False] * 20 + [True] * 6 + [False] * 20
    assert all(1200 <= p <= 1600 for p, _ in burst[20:26])
    mixed = load_workload("gpu-mixed").lengths(400, seed=0)
    long_prompts = [p for p, _ in mixed if p >= 2048]
    assert 0.15 < len(long_prompts) / len(mixed) < 0.25 and max(p for p, _ in mixed) <= 3584
    long_prompt = load_workload("long-prompt")
    assert long_prompt.output_tokens is not None and long_prompt.output_tokens.value == 128
    assert load_workload("shared-prefix").shared_prefix_tokens == 512
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope")


def test_trace_workload(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"prompt_tokens": 10, "output_tokens": 3}\n\n{"prompt_tokens": 20, "output_tokens": 5}\n'
    )
    spec = tmp_path / "w.yaml"
    spec.write_text(
        "name: t\ntrace: t.jsonl\nnum_requests: 3\nrates: [1]\nslo: {ttft_s: 1, tpot_s: 1}\n"
    )
    assert load_workload(str(spec)).lengths(3, seed=0) == [(10, 3), (20, 5), (10, 3)]
    trace.write_text('{"prompt_tokens": 0, "output_tokens": 3}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:1"):
        read_trace(trace)


def test_workload_validation() -> None:
    base = {"name": "w", "num_requests": 1, "rates": [1.0], "slo": {"ttft_s": 1, "tpot_s": 1}}
    with pytest.raises(ValueError, match="trace"):
        Workload.model_validate(base)
    with pytest.raises(ValueError, match="low"):
        Workload.model_validate(
            {**base, "prompt_tokens": {"kind": "uniform", "low": 5, "high": 2},
             "output_tokens": {"kind": "fixed", "value": 1}}
        )  # fmt: skip


def test_prompts_have_the_asked_lengths_and_share_only_the_prefix(tiny_model: Path) -> None:
    from engine.prompts import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model))
    workload = load_workload("shared-prefix")
    first = build_requests(workload, tokenizer, 6, seed=1)
    second = build_requests(workload, tokenizer, 6, seed=2)
    # The prompt lengths land on target: shared prefix + own part (+ special tokens).
    for request, (own, output) in zip(first, workload.lengths(6, seed=1), strict=True):
        assert abs(request.prompt_tokens - (512 + own)) <= 3, request.prompt_tokens
        assert request.max_tokens == output
    prefix = first[0].prompt[:200]
    assert all(r.prompt.startswith(prefix) for r in first + second)
    assert first[0].prompt != second[0].prompt
    assert build_requests(workload, tokenizer, 2, seed=1)[1].prompt == first[1].prompt


def test_judging_again_against_another_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pdserve_cli import main

    report = make_report()
    report.save(tmp_path / "report.json")
    # At 2 req/s disaggregated's TTFT is 1.2 s: it misses 1 s and meets 1.5 s.
    strict = report.runs_of("chat", "disaggregated")[-1].summary.slo_attainment
    loose = report.judged_by(SLO(1.5, 0.1)).runs_of("chat", "disaggregated")[-1].summary
    assert (strict, loose.slo_attainment) == (0.0, 1.0)
    assert report.judged_by(SLO(1.5, 0.1)).max_rate_meeting_slo("chat", "disaggregated") == 2.0
    assert report.judged_by(None, 0.5).attainment_target == 0.5

    assert main(["bench", "compare", str(tmp_path / "report.json"), "--slo-ttft", "1500ms",
                 "--slo-tpot", "100ms"]) == 0  # fmt: skip
    assert "disaggregated / colocated: 2 req/s vs 1 req/s = 2.00x" in capsys.readouterr().out
    out = tmp_path / "loose"
    assert main(["bench", "report", str(tmp_path / "report.json"), "--slo-ttft", "1500ms",
                 "--slo-tpot", "100ms", "--out", str(out)]) == 0  # fmt: skip
    assert "SLO: TTFT <= 1500 ms, TPOT <= 100 ms" in (out / "report.md").read_text()
    assert (out / "chat-vs-rate.png").exists()
    assert main(["bench", "compare", str(tmp_path / "report.json"), "--slo-ttft", "1s"]) == 2
    # An ITL bound judges every gap: 1 ms fails every answer of more than one token.
    itl = tmp_path / "itl"
    assert main(["bench", "report", str(tmp_path / "report.json"), "--slo-ttft", "1500ms",
                 "--slo-tpot", "100ms", "--slo-itl", "1ms", "--out", str(itl)]) == 0  # fmt: skip
    assert (
        "SLO: TTFT <= 1500 ms, TPOT <= 100 ms, P99 gap <= 1 ms" in (itl / "report.md").read_text()
    )
    judged = report.judged_by(SLO(1.5, 0.1, itl_s=0.001))
    assert judged.runs_of("chat", "disaggregated")[-1].summary.slo_attainment == 0.0
    assert main(["bench", "compare", str(tmp_path / "report.json"), "--slo-itl", "1ms"]) == 2

    # Leaving requests out writes beside the full report, never over it.
    saved = (tmp_path / "report.json").read_text()
    assert main(["bench", "report", str(tmp_path / "report.json"), "--max-prompt-tokens",
                 "64"]) == 0  # fmt: skip
    assert (tmp_path / "report.json").read_text() == saved
    assert (tmp_path / "prompts-up-to-64" / "report.md").exists()


def test_kv_transfer_counts_only_requests_that_reached_decode() -> None:
    colocated = synthetic_run("colocated", Arrival("closed", 1), 0.3, 0.05)
    for r in colocated.records:
        assert r.server is not None
        r.server = ServerTimings(0.0, 0.2, 0.4, 0.3, 0.0, 0.6)  # no decode call
    assert colocated.summary.server_kv_transfer is None
    assert synthetic_run("pd", Arrival("closed", 1), 0.3, 0.05).summary.server_kv_transfer
