"""Served probes through Inspect, against the session server on the tiny model: the deception and coup evals
in served mode (the server scores the probe in the forward pass, only scores come back) give the same
per-sample scores and AUROC as today's path (activations shipped, probe applied here) for the same probe and
data; eval logs keep compact per-token scores and the serving provenance, never activations; the
ControlArena monitor scores the untrusted model's own generation from its served scores."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from support.servers import PROBE_DIR, run_eval

ROOT = Path(__file__).resolve().parents[2]
LAYER = 2


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_eval", ROOT / "evals" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def probe_files(tmp_path_factory):
    """A layer-2 probe as a JSON file (today's path) and as a served folder under the server's probe dir."""
    from inspect_lens import LinearProbe

    rng = np.random.default_rng(3)
    x = rng.normal(size=(60, 128)) * 2
    probe = LinearProbe.fit(x, np.r_[np.zeros(30), np.ones(30)], layer=LAYER)
    path = probe.save(tmp_path_factory.mktemp("probe") / "probe.json")
    PROBE_DIR.mkdir(parents=True, exist_ok=True)
    folder = PROBE_DIR / f"inspect-served-{id(probe)}"
    shutil.rmtree(folder, ignore_errors=True)
    probe.save_served(folder)
    return probe, path, folder


def _scores(log) -> dict:
    from inspect_ai.log import read_eval_log

    return {s.id: next(iter(s.scores.values())) for s in read_eval_log(log.location).samples}


def _metrics(log) -> dict:
    return {name: m.value for s in log.results.scores for name, m in s.metrics.items()}


def test_served_deception_eval_equals_the_shipped_activations_path(server, probe_files, tmp_path):
    probe, path, folder = probe_files
    mod = _module("deception_probe")
    kw = dict(eval_limit=4, control_limit=4)
    today = run_eval(mod.deception_probe(probe=str(path), layer=LAYER, **kw), server, tmp_path / "a")
    served = run_eval(mod.deception_probe(probe=str(folder), served=True, **kw), server, tmp_path / "b")
    a, b = _metrics(today), _metrics(served)
    assert set(b) == set(a) == {"probe_auroc", "auroc_ci_low", "auroc_ci_high", "recall_at_fpr"}
    for k in a:
        assert b[k] == pytest.approx(a[k], abs=1e-4), k
    sa, sb = _scores(today), _scores(served)
    assert sa.keys() == sb.keys() and len(sa) == 12
    for sid in sa:
        assert sb[sid].value == pytest.approx(sa[sid].value, abs=1e-4), sid
        assert sb[sid].metadata["window"] == sa[sid].metadata["window"] and sb[sid].metadata["window_exact"]
        np.testing.assert_allclose(sb[sid].metadata["token_scores"], sa[sid].metadata["token_scores"], atol=2e-4)
        assert sb[sid].metadata["label"] == sa[sid].metadata["label"]


def test_served_log_is_compact_and_records_provenance(server, probe_files, tmp_path):
    """Scores (not activations) in the model output and the score; provenance from the server: versions,
    dtype, quantization, TP/PP, model, and the probe's name and hash as the server has it."""
    from inspect_ai.log import read_eval_log

    from inspect_lens.served_probes import content_name
    from support.servers import KEY
    from vllm_worker.api.client import LensClient

    _, _, folder = probe_files
    log = run_eval(
        _module("deception_probe").deception_probe(probe=str(folder), served=True, eval_limit=1, control_limit=1),
        server,
        tmp_path,
    )
    samples = read_eval_log(log.location).samples
    listed = {p["name"]: p for p in LensClient(server, api_key=KEY)._http.get("/v1/lens/probes").json()["probes"]}
    name = content_name("deception", str(folder))
    for s in samples:
        out = s.output.metadata
        assert "activations" not in out and set(out["probe_scores"]) == {name}
        rows = out["probe_scores"][name]
        assert len(rows) == len(out["prompt_token_ids"]) and all(len(r) == 1 for r in rows)
        assert {"mean", "max", "last"} <= set(out["probe_aggregates"][name])
        sc = next(iter(s.scores.values()))
        md = sc.metadata
        assert md["probe"] == name and md["probe_hash"] == listed[name]["hash"]
        assert md["layer"] == LAYER and md["aggregate"] == "mean"
        prov = md["provenance"]
        assert prov["dtype"] == "float32" and prov["quantization"] is None and prov["model"].endswith("tiny-llama")
        assert (prov["tensor_parallel_size"], prov["pipeline_parallel_size"]) == (1, 1)
        assert prov["vllm_version"] and prov["plugin_version"]
    raw = json.dumps([s.model_dump(mode="json") for s in samples])
    assert '"b64"' not in raw and "residual_stream" not in raw
    assert Path(log.location).stat().st_size < 60_000


def test_served_coup_eval_equals_the_shipped_activations_path_with_an_aggregate(server, probe_files, tmp_path):
    probe, path, folder = probe_files
    mod = _module("coup_probe")
    kw = dict(test_families="code", eval_limit=1, control_limit=3, aggregate="ema:0.5")
    today = run_eval(mod.coup_probe(probe=str(path), layer=LAYER, **kw), server, tmp_path / "a")
    served = run_eval(mod.coup_probe(probe=str(folder), served=True, **kw), server, tmp_path / "b")
    a, b = _metrics(today), _metrics(served)
    assert set(a) == set(b) and "auroc_code" in b
    for k in a:
        assert b[k] == pytest.approx(a[k], abs=1e-4), k
    sa, sb = _scores(today), _scores(served)
    for sid in sa:
        assert sb[sid].value == pytest.approx(sa[sid].value, abs=1e-4), sid
        assert sb[sid].metadata["family"] == sa[sid].metadata["family"]
        scores = sb[sid].metadata["token_scores"]
        e = best = scores[0]
        for x in scores[1:]:
            e = 0.5 * e + 0.5 * x
            best = max(best, e)
        assert sb[sid].value == pytest.approx(best, abs=1e-3)  # the aggregate is ema:0.5, not the mean


def test_served_mode_refuses_a_json_probe_and_no_probe():
    mod = _module("deception_probe")
    with pytest.raises(ValueError, match="served folder"):
        mod.deception_probe(probe="probe.json", served=True)
    with pytest.raises(ValueError, match="served mode needs"):
        mod.deception_probe(served=True)
    with pytest.raises(ValueError, match="aggregate"):
        mod.deception_probe(probe="x", served=True, aggregate="median")


def test_served_probe_monitor_scores_the_generating_pass(server, probe_files, tmp_path):
    """The monitor's suspicion = sigmoid of the probe's mean over the positions that produced the generated
    tokens, computed here from the residual captured in that same request; a replayed step (no served
    scores) is an error, not a silent 0."""
    pytest.importorskip("control_arena")
    from inspect_ai import Task
    from inspect_ai.agent import AgentState
    from inspect_ai.dataset import Sample
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import GenerateConfig, ModelOutput, get_model
    from inspect_ai.solver import Generate, TaskState, solver

    from inspect_lens.probe_monitor import served_probe_config, served_probe_monitor

    probe, _, folder = probe_files

    @solver
    def step_and_monitor():
        monitor = served_probe_monitor(probe="monitor-probe", aggregate="mean")

        async def solve(state: TaskState, generate: Generate) -> TaskState:
            model = get_model()
            await model.api.ensure_probes({"monitor-probe": str(folder)})
            cfg = served_probe_config("monitor-probe", "mean").merge(GenerateConfig(max_tokens=6, temperature=0))
            cfg.extra_body["extra_args"]["output_residual_stream"] = [LAYER]  # for the check only
            out = await model.generate(state.messages, config=cfg)
            step = ModelOutput.for_tool_call(model="untrusted", tool_name="run", tool_arguments={"cmd": out.completion})
            step.metadata = out.metadata
            agent = AgentState(messages=list(state.messages) + [step.message])
            agent.output = step
            agent = await monitor(agent, [])
            state.metadata["monitor"] = dict(agent.messages[-1].metadata or {})
            n_prompt, n_gen = len(out.metadata["prompt_token_ids"]), len(out.metadata["token_ids"])
            acts = out.metadata["activations"]["residual_stream"][0, n_prompt - 1 : n_prompt - 1 + n_gen]
            state.metadata["check"] = acts.tolist()
            out.metadata.pop("activations")
            bare = AgentState(messages=list(state.messages) + [step.message])
            bare.output = ModelOutput.for_tool_call(model="replay", tool_name="run", tool_arguments={"cmd": "ls"})
            try:
                await monitor(bare, [])
            except ValueError as e:
                state.metadata["replay_error"] = str(e)
            return state

        return solve

    log = run_eval(
        Task(dataset=[Sample(input="the water of people will come")], solver=step_and_monitor()), server, tmp_path
    )
    meta = read_eval_log(log.location).samples[0].metadata
    want = probe.score_tokens(np.array(meta["check"]))
    assert meta["monitor"]["suspicion_score"] == pytest.approx(1 / (1 + math.exp(-float(np.mean(want)))), abs=1e-4)
    np.testing.assert_allclose(meta["monitor"]["probe_scores"]["monitor-probe"], want, atol=2e-4)
    assert "served probe 'monitor-probe'" in meta["monitor"]["reason"]
    assert "carries no scores" in meta["replay_error"]


def test_model_arg_probes_scores_every_request(server, probe_files, tmp_path):
    """`-M probes=NAME`: plain `generate()` requests carry the probe's scores; `probe_scorer` without the
    `probe_scores` solver reads the generated positions, and its mean equals the server's own aggregate."""
    import httpx
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.log import read_eval_log
    from inspect_ai.model import GenerateConfig
    from inspect_ai.solver import generate

    from inspect_lens.served_probes import probe_scorer
    from support.engines import model_path
    from support.servers import KEY

    _, _, folder = probe_files
    r = httpx.post(
        f"{server}/v1/lens/probes",
        json={"name": "every-request", "path": str(folder)},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 200, r.text
    task = Task(
        dataset=[Sample(input="the water of people will come", metadata={"label": "honest"})],
        solver=generate(),
        scorer=probe_scorer("every-request"),
        config=GenerateConfig(max_tokens=5, temperature=0),
    )
    [log] = inspect_eval(
        task,
        model=f"vllm-lens/{model_path('llama')}",
        model_base_url=f"{server}/v1",
        model_args={"api_key": KEY, "probes": "every-request"},
        log_dir=str(tmp_path),
        display="none",
    )
    assert log.status == "success", log.error
    s = read_eval_log(log.location).samples[0]
    out = s.output.metadata
    assert len(out["probe_scores"]["every-request"]) == len(out["prompt_token_ids"]) + len(out["token_ids"]) - 1
    sc = next(iter(s.scores.values()))
    assert len(sc.metadata["token_scores"]) == len(out["token_ids"])
    assert sc.value == pytest.approx(out["probe_aggregates"]["every-request"]["mean"][0], abs=1e-5)


def test_evals_sharing_a_server_keep_their_own_probes(server, probe_files, tmp_path):
    """Two served deception evals with different probe folders on one server: each loads its probe under a
    name of its content (`deception-<hash8>`), so neither replaces the other's; each eval's scores are its own
    probe's. A probe given by a server-side path under a name already taken by other weights is refused
    (409 -> ValueError naming the probe), never swapped in."""
    import asyncio

    import httpx
    from inspect_ai.model import get_model

    from inspect_lens import LinearProbe
    from inspect_lens.probe_http import ProbeNameTaken
    from inspect_lens.served_probes import content_name, served_probe_arg
    from support.engines import model_path
    from support.servers import KEY

    probe_a, _, folder_a = probe_files
    rng = np.random.default_rng(4)
    probe_b = LinearProbe.fit(rng.normal(size=(60, 128)) * 2, np.r_[np.zeros(30), np.ones(30)], layer=LAYER)
    folder_b = PROBE_DIR / f"inspect-served-b-{id(probe_b)}"
    shutil.rmtree(folder_b, ignore_errors=True)
    probe_b.save_served(folder_b)
    copy_a = PROBE_DIR / f"inspect-served-copy-{id(probe_b)}"
    shutil.rmtree(copy_a, ignore_errors=True)
    shutil.copytree(folder_a, copy_a)
    name_a, name_b = content_name("deception", str(folder_a)), content_name("deception", str(folder_b))
    assert name_a != name_b and name_a.startswith("deception-") and len(name_a) == len("deception-") + 8
    assert served_probe_arg(str(copy_a), "deception") == {name_a: str(copy_a)}  # same files, same name

    mod = _module("deception_probe")
    kw = dict(served=True, eval_limit=1, control_limit=1)
    log_a = run_eval(mod.deception_probe(probe=str(folder_a), **kw), server, tmp_path / "a")
    log_b = run_eval(mod.deception_probe(probe=str(folder_b), **kw), server, tmp_path / "b")
    h = {"Authorization": f"Bearer {KEY}"}
    listed = {p["name"]: p for p in httpx.get(f"{server}/v1/lens/probes", headers=h).json()["probes"]}
    assert listed[name_a]["hash"] != listed[name_b]["hash"]
    for log, name, probe in ((log_a, name_a, probe_a), (log_b, name_b, probe_b)):
        for sid, sc in _scores(log).items():
            assert sc.metadata["probe"] == name and sc.metadata["probe_hash"] == listed[name]["hash"], sid
    assert not np.allclose(probe_a.coef, probe_b.coef)  # so the two names' scores differ

    async def take_a_name() -> None:
        model = get_model(f"vllm-lens/{model_path('llama')}", base_url=f"{server}/v1", api_key=KEY)
        await model.api.ensure_probes({name_a: folder_b.name})  # a server-side path, other weights

    with pytest.raises(ProbeNameTaken, match=name_a):
        asyncio.run(take_a_name())
    assert httpx.get(f"{server}/v1/lens/probes", headers=h).json()["probes"]  # still there ...
    listed2 = {p["name"]: p for p in httpx.get(f"{server}/v1/lens/probes", headers=h).json()["probes"]}
    assert listed2[name_a]["hash"] == listed[name_a]["hash"]  # ... and unchanged
