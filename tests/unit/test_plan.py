"""The planner (deploy/plan.py): its model of the app on a virtual clock is exact where one
request runs alone (each step as long as the profile says), it finds the interference
disaggregation removes, and `topology: auto` becomes the configuration it picks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deploy.config import AppConfig
from deploy.plan import (
    AppModel,
    Candidate,
    CandidatePlan,
    EngineShape,
    Plan,
    RunResult,
    Trace,
    candidates,
    format_plan,
    plan,
    plan_for,
    resolve_auto,
    work_bound,
)
from deploy.workload import Workload
from engine.sim.blocks import BlockPool
from engine.sim.profile import Link, SimProfile, StepCosts, load_link, load_profile
from engine.sim.scheduler import SimRequest, SimScheduler
from engine.sim.tokens import TokenSource

# Every cost non-zero, so each term of a step is checked.
PROFILE = SimProfile(
    name="test",
    step=StepCosts(
        base_s=0.01,
        prefill_token_s=0.001,
        prefill_attention_s=1e-6,
        decode_seq_s=0.002,
        decode_context_s=1e-5,
    ),
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    kv_dtype_bytes=2,
    kv_cache_bytes=64 * 1024**2,
)
LINK = Link("test", bandwidth_bytes_per_s=1e6, latency_s=0.003)
SHAPE = EngineShape(kv_cache_bytes=None, block_size=16)
CPU = load_profile("cpu-smollm2")
CPU_SHAPE = EngineShape(kv_cache_bytes=512 * 1024**2, block_size=32, max_model_len=4096)


def alone(prompt: int, output: int) -> Trace:
    return Trace(((prompt, output),), (1.0,), 0, duration_s=1.0, min_requests=1)


def workload(
    prompt: tuple[int, int], output: tuple[int, int], ttft: float, tpot: float
) -> Workload:
    return Workload.model_validate(
        {
            "name": "test",
            "prompt_tokens": {"kind": "uniform", "low": prompt[0], "high": prompt[1]},
            "output_tokens": {"kind": "uniform", "low": output[0], "high": output[1]},
            "num_requests": 1,
            "rates": [1.0],
            "slo": {"ttft_s": ttft, "tpot_s": tpot},
        }
    )


def run_alone(kind: str, prompt: int, output: int) -> tuple[float, float]:
    candidate = Candidate("colocated", 0, 1) if kind == "colocated" else Candidate(kind, 1, 1)  # type: ignore[arg-type]
    model = AppModel(candidate, PROFILE, LINK, SHAPE, ttft_slo_s=60, tpot_slo_s=60)
    result = model.run(alone(prompt, output), rate=1.0)
    assert result.attainment == 1.0
    return result.ttft_p90_s, result.tpot_p90_s


def test_a_request_alone_takes_the_profile_s_steps_and_the_link_s_transfer() -> None:
    prompt, output = 100, 10
    prefill = PROFILE.step_seconds([(0, prompt)], [])
    # Tokens 2..10 each take a decode step, at contexts 101..109.
    decode = sum(PROFILE.step_seconds([], [prompt + k]) for k in range(1, output))
    ttft, tpot = run_alone("colocated", prompt, output)
    assert ttft == pytest.approx(prefill, rel=1e-9)
    assert tpot == pytest.approx(decode / (output - 1), rel=1e-9)
    # Disaggregated: the same prefill; then the KV over the link, one step computing the last
    # prompt position (its token is the prefill engine's, dropped), and the same decode steps.
    transfer = LINK.transfer_seconds(prompt * PROFILE.kv_bytes_per_token)
    last_position = PROFILE.step_seconds([(prompt - 1, 1)], [])
    ttft, tpot = run_alone("disaggregated", prompt, output)
    assert ttft == pytest.approx(prefill, rel=1e-9)
    assert tpot == pytest.approx((transfer + last_position + decode) / (output - 1), rel=1e-9)


def test_a_request_s_least_compute_is_its_steps_without_their_base() -> None:
    """`SimProfile.request_seconds` against the sim scheduler's own steps: a 100-token prompt
    in chunks of 32 (the attention is the same however it is chunked), then a second request
    whose first 64 prompt tokens are cached, each alone, each step timed by the profile less
    its base."""

    def steps_less_base(scheduler: SimScheduler, request: SimRequest) -> float:
        scheduler.add(request)
        seconds = 0.0
        while scheduler.num_unfinished:
            step = scheduler.schedule(0.0)
            seconds += PROFILE.step_seconds(step.prefill_chunks, step.decode_contexts)
            seconds -= PROFILE.step.base_s
            scheduler.complete(step)
        return seconds

    scheduler = SimScheduler(BlockPool(64, 16), TokenSource(range(100)), 32, 8, 1024)
    first = SimRequest("a", tuple(range(100)), 7, 1)
    assert steps_less_base(scheduler, first) == pytest.approx(PROFILE.request_seconds(100, 7))
    again = SimRequest("b", tuple(range(64)) + tuple(range(500, 550)), 5, 2)
    assert steps_less_base(scheduler, again) == pytest.approx(
        PROFILE.request_seconds(114, 5, cached_tokens=64)
    )
    assert again.num_cached_tokens == 64
    # The terms by hand: 50 uncached tokens at 1 ms, their attention 50 x (64 + 25) at 1 us,
    # four decode tokens at 2 ms and at contexts 115-118 at 10 us each.
    assert PROFILE.request_seconds(114, 5, 64) == pytest.approx(
        0.05 + 50 * 89e-6 + 0.008 + (115 + 116 + 117 + 118) * 1e-5
    )
    with pytest.raises(ValueError, match="cached_tokens <= prompt_tokens"):
        PROFILE.request_seconds(10, 5, cached_tokens=11)


def test_the_work_bound_is_the_engines_seconds_over_the_mean_request() -> None:
    trace = Trace(((100, 8), (300, 2)), (0.0, 1.0), 0, duration_s=1.0, min_requests=2)
    mean = (PROFILE.request_seconds(100, 8) + PROFILE.request_seconds(300, 2)) / 2
    assert work_bound(trace, PROFILE, 4) == pytest.approx(4 / mean)


def test_candidates_for_n_engines() -> None:
    names = [c.name for c in candidates(3)]
    assert names == [
        "colocated x3",
        "disaggregated 1:2",
        "disaggregated 2:1",
        "adaptive 0:3",
        "adaptive 1:2",
        "adaptive 2:1",
    ]
    assert [c.name for c in candidates(1)] == ["colocated x1"]
    assert [c.name for c in candidates(2, width=2)][:2] == [
        "colocated x2 (2-wide)",
        "disaggregated 1:1 (2-wide)",
    ]
    assert [c.name for c in candidates(2, chunk_budget=512)][:2] == [
        "colocated x2 chunk 512",
        "disaggregated 1:1 chunk 512",
    ]
    with pytest.raises(ValueError, match="engines"):
        candidates(0)


def test_adaptive_with_no_prefill_engine_runs_as_colocated() -> None:
    """Adaptive 0:N (a split that lent every prefill engine to decoding): the decider computes
    each prompt on its decode engine, so the run is colocated's to the request, and a plan
    whose best is it starts the app colocated."""
    chat = workload((64, 192), (32, 96), ttft=2.0, tpot=0.3)
    trace = Trace.of(chat, duration_s=20, min_requests=30)

    def run(candidate: Candidate) -> RunResult:
        model = AppModel(candidate, CPU, load_link(CPU.default_link), CPU_SHAPE, 2.0, 0.3)
        return model.run(trace, rate=1.5)

    alone = run(Candidate("adaptive", 0, 2))
    assert alone == run(Candidate("colocated", 0, 2))
    assert alone.num_remote == 0 and alone.num_local == trace.num_requests(1.5)
    assert run(Candidate("adaptive", 1, 1)).num_remote > 0  # with an engine to send them to


def test_local_stall_is_a_local_prompts_compute_less_the_median_gap() -> None:
    """Adaptive 0:1, a 10-token answer streaming when a 1,000-token prompt arrives: the long
    prompt's step, less the streams' median TPOT, is what it adds to a gap (the live split's
    signal, P95 over the local prompts: the long one here)."""
    trace = Trace(((10, 10), (1000, 2)), (0.0, 0.05), 0, duration_s=1.0, min_requests=2)
    model = AppModel(Candidate("adaptive", 0, 1), PROFILE, LINK, SHAPE, 60.0, 1.0)
    result = model.run(trace, rate=1.0)
    assert result.num_local == 2 and result.local_stall_s is not None
    long_step = PROFILE.step_seconds([(0, 1000)], [20])
    # The long step less the median of the two answers' TPOT (the 10-token one waited it).
    assert long_step - 0.2 < result.local_stall_s < long_step - 0.05, (long_step, result)
    # At a budget of 100 tokens the prompt is 10 steps: one of them is what a gap holds.
    chunked = AppModel(
        Candidate("adaptive", 0, 1, chunk_budget=100), PROFILE, LINK, SHAPE, 60.0, 1.0
    ).run(trace, rate=1.0)
    assert chunked.local_stall_s is not None and chunked.local_stall_s < 0.3 * long_step
    split = AppModel(Candidate("adaptive", 1, 1), PROFILE, LINK, SHAPE, 60.0, 1.0)
    learning = split.run(trace, rate=1.0)  # the unfitted decider sends its first one remote
    assert learning.num_remote >= 1


def test_a_split_is_picked_only_for_min_gain_over_colocated() -> None:
    def planned(split_goodput: float) -> Plan:
        results = tuple(
            CandidatePlan(c, goodput, None)
            for c, goodput in zip(candidates(2)[:3], (1.0, split_goodput, 0.5), strict=True)
        )
        return Plan("w", "p", 2, 1.0, 0.1, 0.9, results, min_gain=1.1)

    close = planned(1.05)
    assert close.highest.candidate.name == "disaggregated 1:1"
    assert close.best.candidate.name == "colocated x2"
    assert "predicts 1.05 (1.05x), under the 1.1x a split must gain" in close.reason()
    clear = planned(1.2)
    assert clear.best.candidate.name == "disaggregated 1:1"
    assert clear.reason().endswith("1.20x the next best (colocated x2)")


def test_long_prompts_at_a_tight_tpot_are_served_best_disaggregated() -> None:
    """On the CPU profile a 1,000-1,500-token prefill is a 2-3.6 s step: on a colocated engine
    every stream decoding there waits that long for its next token, so a 0.15 s TPOT holds
    only at rates where prompts rarely overlap a stream. Split 1:1, the decode engine never
    prefills."""
    long = workload((1000, 1500), (32, 64), ttft=20.0, tpot=0.15)
    trace = Trace.of(long, duration_s=60, min_requests=30)
    result = plan(long, CPU, load_link(CPU.default_link), 2, CPU_SHAPE, trace=trace)
    goodput = {r.candidate.name: r.goodput for r in result.results}
    assert result.best.candidate.name == "disaggregated 1:1", goodput
    assert goodput["disaggregated 1:1"] >= 1.5 * goodput["colocated x2"], goodput
    # The search brackets it: met at the goodput, missed at twice the rate.
    best = result.best
    assert best.at_goodput is not None and best.at_goodput.attainment >= 0.9
    model = AppModel(best.candidate, CPU, load_link(CPU.default_link), CPU_SHAPE, 20.0, 0.15)
    assert model.run(trace, 2 * best.goodput).attainment < 0.9
    text = format_plan(result)
    assert "pick: disaggregated 1:1 serves" in text and "x the next best" in text


def test_an_itl_slo_counts_the_stall_a_mean_tpot_absorbs() -> None:
    """A 1,000-token prompt arrives while a 100-token answer streams on the same colocated
    engine: that stream waits for the prompt's prefill steps once. Spread over its 99 gaps the
    wait leaves its mean TPOT under 0.1 s, but its P99 gap is the wait itself; split 1:1, the
    prompt is computed on the other engine and the stream's largest gap is its own handoff
    (the KV transfer and a decode step, 31 ms)."""
    trace = Trace(((10, 100), (1000, 1)), (0.0, 0.5), 0, duration_s=1.0, min_requests=2)

    def run(candidate: Candidate, itl_slo_s: float | None) -> tuple[float, float, float]:
        model = AppModel(candidate, PROFILE, LINK, SHAPE, 60.0, 0.1, itl_slo_s)
        result = model.run(trace, rate=1.0)
        return result.attainment, result.tpot_p90_s, result.itl_p90_s

    colocated = Candidate("colocated", 0, 1)
    attainment, tpot, itl = run(colocated, None)
    assert attainment == 1.0 and tpot < 0.1 and itl > 0.5, (tpot, itl)
    assert run(colocated, 0.1)[0] == 0.5
    attainment, tpot, itl = run(Candidate("disaggregated", 1, 1), 0.1)
    assert attainment == 1.0 and itl < 0.05, (tpot, itl)


def test_a_small_chunk_budget_cuts_a_long_prompt_into_stalls_the_itl_slo_allows() -> None:
    """The same 1,000-token prompt beside the same stream, on one colocated engine whose
    chunked-prefill budget is 100 tokens: ten steps of 100 prompt tokens each, every one a gap
    of 0.11-0.21 s (the attention grows with the prompt's part computed), where the whole
    prompt in one step was a gap of 1.5 s."""
    trace = Trace(((10, 100), (1000, 1)), (0.0, 0.5), 0, duration_s=1.0, min_requests=2)
    gaps = {}
    for budget in (None, 100):
        model = AppModel(
            Candidate("colocated", 0, 1, chunk_budget=budget), PROFILE, LINK, SHAPE, 60, 0.1, 0.3
        )
        result = model.run(trace, rate=1.0)
        gaps[budget] = (result.attainment, result.itl_p90_s)
    assert gaps[None][0] == 0.5 and gaps[None][1] > 0.5, gaps
    assert gaps[100][0] == 1.0 and 0.1 < gaps[100][1] < 0.25, gaps


def test_short_prompts_at_a_loose_tpot_stay_colocated() -> None:
    """Chat on the CPU profile at a 0.3 s TPOT: a prefill of at most 192 tokens costs a
    stream one step of 0.2-0.4 s, and both engines of colocated x2 serve requests whole,
    where 1:1 leaves one engine's decode batch to carry every stream."""
    chat = workload((64, 192), (32, 96), ttft=2.0, tpot=0.3)
    trace = Trace.of(chat, duration_s=60, min_requests=30)
    result = plan(chat, CPU, load_link(CPU.default_link), 2, CPU_SHAPE, trace=trace)
    goodput = {r.candidate.name: r.goodput for r in result.results}
    assert result.best.candidate.name == "colocated x2", goodput
    assert goodput["colocated x2"] > goodput["disaggregated 1:1"], goodput
    # No candidate passes the work bound (two engines' seconds over the mean request's
    # compute), and the best is not far under it: the bound is not vacuous.
    assert result.work_bound_rps == work_bound(trace, CPU, 2)
    assert 0.5 * result.work_bound_rps < result.highest.goodput < result.work_bound_rps
    assert f"work bound: {result.work_bound_rps:.3g} req/s" in format_plan(result)


def test_adaptive_decisions_are_counted_and_both_paths_are_taken() -> None:
    """The adaptive candidate runs the router's own decider: while it learns the transfer
    rate, one request in 4 goes remote; the rest of its choices follow the predictions."""
    long = workload((1000, 1500), (32, 64), ttft=20.0, tpot=0.15)
    model = AppModel(
        Candidate("adaptive", 1, 1), CPU, load_link(CPU.default_link), CPU_SHAPE, 20.0, 0.15
    )
    result = model.run(Trace.of(long, duration_s=60, min_requests=30), rate=0.05)
    assert result.num_local + result.num_remote == 30
    assert result.num_remote >= 3 and result.num_local >= 1, result


def _auto_config(tmp_path: Path, long_prompts: bool) -> AppConfig:
    path = tmp_path / "workload.yaml"
    spec = (
        workload((1000, 1500), (32, 64), ttft=20.0, tpot=0.15)
        if long_prompts
        else workload((64, 192), (32, 96), ttft=2.0, tpot=0.3)
    )
    path.write_text(yaml.safe_dump(json.loads(spec.model_dump_json(exclude_none=True))))
    return AppConfig.model_validate(
        {
            "topology": "auto",
            "engine": {"kv_cache_memory_bytes": 512 * 1024**2, "max_model_len": 4096},
            "plan": {"workload": str(path), "profile": "cpu-smollm2"},
            "decode": {"min_replicas": 1, "max_replicas": 2},
        }
    )


def test_topology_auto_becomes_the_configuration_the_plan_picks(tmp_path: Path) -> None:
    config, chosen = resolve_auto(_auto_config(tmp_path, long_prompts=True))
    assert chosen is not None and chosen.num_engines == 2
    assert chosen.best.candidate.name == "disaggregated 1:1"
    assert config.topology == "disaggregated"
    assert (config.prefill.num_replicas, config.decode.num_replicas) == (1, 1)
    assert config.router.adaptive_prefill is False

    config, chosen = resolve_auto(_auto_config(tmp_path, long_prompts=False))
    assert chosen is not None and chosen.best.candidate.name == "colocated x2"
    assert config.topology == "colocated"
    assert config.colocated.num_replicas == 2 and config.colocated.max_replicas >= 2
    assert set(config.pools) == {"engine"}
    assert config.colocated.cores_per_replica is None  # no cores named: nothing to slice


def test_topology_auto_weighs_chunk_budgets_and_sets_the_pick_s(tmp_path: Path) -> None:
    """Long prompts under a 0.5 s ITL SLO on the CPU profile: a colocated engine at a 128-token
    budget stalls its streams 0.26 s a step, at 4,096 a whole prompt's 2-3 s, so colocated
    serves over twice the rate at 128. The pick's budget becomes the engines' own."""
    config = _auto_config(tmp_path, long_prompts=True)
    path = Path(config.plan.workload)
    spec = yaml.safe_load(path.read_text())
    spec["slo"]["itl_s"] = 0.5
    path.write_text(yaml.safe_dump(spec))
    data = config.model_dump()
    data["plan"]["chunk_budgets"] = [4096, 128]
    config, chosen = resolve_auto(AppConfig.model_validate(data))
    assert chosen is not None
    goodput = {r.candidate.name: r.goodput for r in chosen.results}
    assert len(goodput) == 8, goodput
    # Adaptive 0:2 is colocated's run (a split that lent its prefill engine), not a new one.
    assert goodput["adaptive 0:2 chunk 128"] == goodput["colocated x2 chunk 128"], goodput
    assert goodput["colocated x2 chunk 128"] > 2 * goodput["colocated x2 chunk 4096"], goodput
    best = chosen.best.candidate
    assert best.chunk_budget in (128, 4096)
    assert config.engine.engine_kwargs["max_num_batched_tokens"] == best.chunk_budget
    with pytest.raises(ValueError, match="chunk budgets"):
        AppConfig.model_validate({"plan": {"chunk_budgets": [0]}})


def test_topology_auto_gives_each_planned_engine_its_own_cores(tmp_path: Path) -> None:
    """The plan models two engines; a pool of two cores starts two replicas of one core each,
    not two on both (the measured gap of docs/benchmarks.md)."""
    data = _auto_config(tmp_path, long_prompts=False).model_dump()
    data["colocated"]["cpu_cores"] = [0, 1]
    config, chosen = resolve_auto(AppConfig.model_validate(data))
    assert chosen is not None and chosen.best.candidate.name == "colocated x2"
    assert (config.colocated.num_replicas, config.colocated.cores_per_replica) == (2, 1)
    # What the config says wins; one core cannot be sliced for two.
    data["colocated"]["cores_per_replica"] = 2
    config, _ = resolve_auto(AppConfig.model_validate(data))
    assert config.colocated.cores_per_replica == 2
    data["colocated"].update(cpu_cores=[0], cores_per_replica=None)
    config, _ = resolve_auto(AppConfig.model_validate(data))
    assert config.colocated.cores_per_replica is None


def test_other_topologies_pass_unplanned_and_bad_plan_fields_are_named() -> None:
    config = AppConfig()
    assert resolve_auto(config) == (config, None)
    with pytest.raises(ValueError, match=r"plan\.attainment"):
        AppConfig.model_validate({"topology": "auto", "plan": {"attainment": 0}})
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        resolve_auto(AppConfig.model_validate({"topology": "auto", "plan": {"workload": "nope"}}))
    zero = AppConfig.model_validate({"topology": "auto", "plan": {"profile": "zero"}})
    with pytest.raises(ValueError, match="sim profile zero: its steps take no time"):
        resolve_auto(zero)
    too_long = AppConfig.model_validate(
        {"topology": "auto", "plan": {"workload": "long-prompt"}, "engine": {"max_model_len": 512}}
    )
    with pytest.raises(ValueError, match="longer than the engines' max_model_len 512"):
        resolve_auto(too_long)


def test_the_plan_section_s_slo_replaces_the_workload_s() -> None:
    """`plan.ttft_s` / `plan.tpot_s` (what `pdserve plan --ttft/--tpot` and `bench run --systems
    auto --slo-*` set) are the SLO the candidates are judged by; either alone keeps the other."""
    config = AppConfig.model_validate(
        {"topology": "auto", "plan": {"workload": "chat", "ttft_s": 2.0, "tpot_s": 0.3}}
    )
    result = plan_for(config)
    assert (result.ttft_slo_s, result.tpot_slo_s) == (2.0, 0.3)
    one = AppConfig.model_validate({"topology": "auto", "plan": {"tpot_s": 0.3}})
    assert (plan_for(one).ttft_slo_s, plan_for(one).tpot_slo_s) == (1.5, 0.3)  # chat's TTFT
    with_itl = plan_for(AppConfig.model_validate({"topology": "auto", "plan": {"itl_s": 0.5}}))
    assert with_itl.itl_slo_s == 0.5 and "ITL (P99 gap) 0.5 s" in format_plan(with_itl)
    with pytest.raises(ValueError, match=r"plan\.tpot_s"):
        AppConfig.model_validate({"topology": "auto", "plan": {"tpot_s": 0}})


def test_wider_engines_are_weighed_and_the_pick_gets_their_cores(tmp_path: Path) -> None:
    """`plan.wider_engines`: beside two engines of the one-core fit, one engine on two cores,
    timed by its own fit (decode step 35 against 52 ms at one sequence). At a 45 ms TPOT only
    the wide engine meets the SLO; it is picked and its replica gets both cores."""
    path = tmp_path / "workload.yaml"
    spec = workload((64, 192), (32, 96), ttft=2.0, tpot=0.045)
    path.write_text(yaml.safe_dump(json.loads(spec.model_dump_json(exclude_none=True))))
    data = {
        "topology": "auto",
        "engine": {"kv_cache_memory_bytes": 512 * 1024**2, "max_model_len": 4096},
        "plan": {
            "workload": str(path),
            "profile": "cpu-smollm2-fit",
            "wider_engines": {2: "cpu-smollm2-2c-fit"},
        },
        "colocated": {"cpu_cores": [0, 1]},
    }
    config, chosen = resolve_auto(AppConfig.model_validate(data))
    assert chosen is not None
    names = [r.candidate.name for r in chosen.results]
    assert names == [
        "colocated x2",
        "disaggregated 1:1",
        "adaptive 0:2",
        "adaptive 1:1",
        "colocated x1 (2-wide)",
    ]
    goodput = {r.candidate.name: r.goodput for r in chosen.results}
    assert goodput["colocated x2"] == 0 and goodput["colocated x1 (2-wide)"] > 0.5, goodput
    assert chosen.best.candidate.name == "colocated x1 (2-wide)"
    assert chosen.colocated is chosen.best  # the baseline a split must beat is the best colocated
    assert config.topology == "colocated"
    assert (config.colocated.num_replicas, config.colocated.cores_per_replica) == (1, 2)

    data["plan"]["wider_engines"] = {3: "cpu-smollm2-2c-fit"}
    with pytest.raises(ValueError, match="an engine 3 wide does not fit 2 engines"):
        resolve_auto(AppConfig.model_validate(data))
    data["plan"]["wider_engines"] = {1: "cpu-smollm2-2c-fit"}
    with pytest.raises(ValueError, match=r"plan\.wider_engines[\s\S]*at least 2"):
        AppConfig.model_validate(data)
