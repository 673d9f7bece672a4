"""Every eval in evals/ as its docstring says to run it, from a clean state. What the per-eval tests
(test_oracle, test_deception_eval, test_coup_probe, test_control, test_petri) do not cover:

- the activation-oracle eval with no oracle anywhere: loaded the way `inspect eval evals/...py -T ...`
  loads it (from its file, task arguments parsed as the CLI parses them), it fits its oracle on the
  served base model into an empty user cache before the task runs, evaluates with it, and a second
  run reuses the cached oracle without fitting again;
- each eval module's docstring command parses with `inspect eval`'s own option parser, names its own
  file, and every `-T` name is a parameter of its task (extras named by `pip install` lines exist);
- `evals/summary.py` (what scripts/main.sh prints) on a deception-probe log made from the eval's file.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from support import load_script
from support.engines import model_path
from support.servers import run_eval

ROOT = Path(__file__).resolve().parents[2]
EVALS = ROOT / "evals"
TASKS = ("activation_oracle", "control_agentdojo", "coup_probe", "deception_probe", "petri_audit")


def _docstring_commands(path: Path) -> list[str]:
    """The shell commands of a module docstring (backslash continuations joined)."""
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
    cmds, cur = [], None
    for line in doc.splitlines():
        s = line.strip()
        if cur is None:
            # (indented in most docstrings; ruff's formatter dedents a docstring whose only body is a command)
            if not re.match(r"(inspect eval|python \S+\.py|pip install) ", s):
                continue
            cur = s
        else:
            cur += " " + s
        if cur.endswith("\\"):
            cur = cur[:-1].rstrip()
            continue
        cmds.append(cur)
        cur = None
    assert cur is None, f"{path.name}: a docstring command ends in a backslash"
    return cmds


def _task_params(path: Path, name: str) -> list[str]:
    """Parameter names of the `@task` function `name` (read from the source: no imports needed)."""
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.FunctionDef)
            and node.name == name
            and any(
                (d.id if isinstance(d, ast.Name) else getattr(d, "attr", None)) == "task" for d in node.decorator_list
            )
        ):
            return [a.arg for a in node.args.args + node.args.kwonlyargs]
    raise AssertionError(f"{path.name}: no @task function {name}")


def _parse_inspect_eval(cmd: str) -> dict:
    """`inspect eval ...` through inspect's own click parser: unknown options are errors. Optional parts
    (`[...]`) are included; metavariables (`<model>`) become one word."""
    from inspect_ai._cli.eval import eval_command
    from inspect_ai._util.config import parse_cli_args

    words = shlex.split(re.sub(r"<[^>]*>", "MODEL", cmd.replace("[", " ").replace("]", " ")))
    assert words[:2] == ["inspect", "eval"], cmd
    params = eval_command.make_context("eval", words[2:]).params
    return {**params, "task_args": parse_cli_args(params["t"])}


def test_docstring_commands_parse():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in TASKS:
        path = EVALS / f"{name}.py"
        cmds = _docstring_commands(path)
        evals = [c for c in cmds if c.startswith("inspect eval ")]
        assert evals, f"{path.name}: no `inspect eval` command in its docstring"
        params = _task_params(path, name)
        for cmd in evals:
            got = _parse_inspect_eval(cmd)
            assert got["tasks"] == (f"evals/{name}.py",), (name, got["tasks"])  # its own file, no stray words
            assert got["model"] or any(r.startswith("target=") for r in got["model_role"]), cmd
            unknown = set(got["task_args"]) - set(params)
            assert not unknown, f"{path.name}: -T {sorted(unknown)} are not parameters of {name}{tuple(params)}"
        for cmd in cmds:
            if cmd.startswith("pip install"):
                for extra in re.findall(r"\.\[([\w,-]+)\]", cmd):
                    assert set(extra.split(",")) <= set(extras), (path.name, cmd)
            if cmd.startswith("python "):
                assert (ROOT / shlex.split(cmd)[1]).exists(), (path.name, cmd)
    # the oracle's placeholder has a leading space: the docstring's YAML quoting keeps it through -T
    [cmd] = [c for c in _docstring_commands(EVALS / "activation_oracle.py") if c.startswith("inspect eval")]
    assert _parse_inspect_eval(cmd)["task_args"]["placeholder"] == " ?"
    [summary] = _docstring_commands(EVALS / "summary.py")
    assert summary.startswith("python evals/summary.py ")


def test_activation_oracle_refuses_clearly_without_a_base_model(tmp_path):
    """Built outside an eval (no active model) with no oracle and no `base`: an error saying what to pass,
    before anything is fitted; a folder that is not an oracle is never written into."""
    mod = load_script(EVALS / "activation_oracle.py")
    with pytest.raises(ValueError, match=r"pass -T base=.* or -T oracle="):
        mod.activation_oracle(oracle=str(tmp_path / "none-yet"))
    assert not (tmp_path / "none-yet").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not an oracle folder"):
        mod.activation_oracle(oracle=str(busy), base=str(model_path("llama")))
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="placeholder: expected a string"):
        mod.activation_oracle(placeholder={None: None})  # what an unquoted `-T placeholder= ?` parses to


def test_activation_oracle_fits_its_oracle_on_first_use_then_reuses_it(lora_server, tmp_path, monkeypatch):
    """No oracle anywhere: the eval, loaded from its file with CLI-parsed `-T` arguments on the LoRA server's
    served name, fits one on the served base model into the user cache, evaluates with it, and a second run
    uses the cached oracle untouched (same files, same answers) even when asked for other fitting steps."""
    from inspect_ai._util.config import parse_cli_args

    from support.servers import LORA_MODEL

    base = model_path("llama")  # (the test models live in the user cache too: resolved before it moves)
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))  # a clean user cache: no oracle anywhere
    monkeypatch.chdir(ROOT)  # as the docstring runs it (Inspect takes the task file relative to the cwd)
    oracle = cache / "inspect-lens" / "oracles" / f"{base.name}-topic-L2"
    # the served name is not a folder: the base model is found from the server (`/v1/models` root)
    cli = ["source_layer=2", "steps=4", "placeholder=' the'"]

    def run(args: list[str]):
        log = run_eval(
            "evals/activation_oracle.py",
            lora_server,
            tmp_path / "logs",
            model=f"vllm-lens/{LORA_MODEL}",
            task_args=parse_cli_args(args),
            limit=8,
        )
        assert {s.name for s in log.results.scores} >= {"real", "shuffled", "none"}
        assert len(log.samples) == 8 and len({s.target for s in log.samples}) == 8
        assert all(s.metadata["activation_oracle"]["oracle"] == str(oracle) for s in log.samples)
        return log

    first = run(cli)
    meta = json.loads((oracle / "oracle.json").read_text())
    assert (oracle / "adapter_config.json").exists() and (oracle / "adapter_model.safetensors").exists()
    assert (meta["base_model"], meta["source_layer"], meta["placeholder"], meta["steps"]) == (str(base), 2, " the", 4)
    assert set(meta["held_out_accuracy"]) == {"real", "shuffled", "none"}
    assert sorted(p.name for p in oracle.parent.iterdir()) == [oracle.name]  # no partial folder left behind
    assert first.samples[0].metadata["activation_oracle"]["source_layer"] == 2
    stamp = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in oracle.iterdir()}

    # second run: the cached oracle is used as it is (fitting args only matter when fitting)
    second = run([*cli[:2], "steps=500"])
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in oracle.iterdir()} == stamp
    assert sorted(p.name for p in oracle.parent.iterdir()) == [oracle.name]
    answers = lambda log: {s.id: s.metadata["activation_oracle"]["answers"] for s in log.samples}  # noqa: E731
    assert answers(second) == answers(first)


def test_activation_oracle_cli_limit_on_a_server_the_provider_starts(tiny_oracle, tmp_path):
    """The docstring's command in its shortest form, as a shell runs it, with Inspect's own `--limit`: the
    provider starts `vllm-lens serve` itself — with LoRA on because the oracle solver asks for it before
    the server starts (no `-M enable_lora` / `max_lora_rank`; the `-M` flags below only size the tiny
    model's engine) — and the first 8 texts are one per topic, so the no-vector control, whose prompt and
    answer never change, is right on at most one of them."""
    import os

    from inspect_ai.log import read_eval_log

    from inspect_lens.oracle_data import TOPICS, topic_samples
    from support import pythonpath
    from support.engines import COMPILED, KV_BYTES

    engine = ["dtype=float32", "max_model_len=512", f"kv_cache_memory_bytes={KV_BYTES}", "host=127.0.0.1"]
    engine += [] if COMPILED else ["enforce_eager=true"]
    cmd = [
        str(Path(sys.executable).parent / "inspect"),
        "eval",
        "evals/activation_oracle.py",
        "--model",
        f"vllm-lens/{model_path('llama')}",
        "--limit",
        "8",
        "-T",
        f"oracle={tiny_oracle}",
        *[w for m in engine for w in ("-M", m)],
        "--log-dir",
        str(tmp_path),
        "--display",
        "none",
    ]
    env = dict(os.environ, PYTHONPATH=pythonpath(str(ROOT)), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    env.pop("VLLM_BASE_URL", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    [path] = tmp_path.glob("*.eval")
    log = read_eval_log(str(path))
    assert log.status == "success", log.error
    assert not {"enable_lora", "max_lora_rank"} & set(log.eval.model_args)
    assert {s.id for s in log.samples} == {s.id for s in topic_samples()[:8]}
    assert sorted(s.target for s in log.samples) == sorted(TOPICS)  # one per topic
    answers = [s.metadata["activation_oracle"]["answers"] for s in log.samples]
    assert all(set(a) == {"real", "shuffled", "none"} for a in answers)  # every LoRA request answered
    assert len({a["none"] for a in answers}) == 1
    acc = {s.name: s.metrics["accuracy"].value for s in log.results.scores}
    assert acc["none"] <= 1 / 8, acc


def test_deception_probe_from_its_file_then_summary(server, tmp_path, monkeypatch):
    """`inspect eval evals/deception_probe.py -T ...` then `python evals/summary.py LOG_DIR` (scripts/main.sh):
    the summary prints the log's metrics, the per-label means, the probe trained beside the log, the log."""
    from inspect_ai._util.config import parse_cli_args

    args = parse_cli_args(["layer=2", "train_limit=6", "eval_limit=3", "control_limit=4"])
    monkeypatch.chdir(ROOT)
    log = run_eval("evals/deception_probe.py", server, tmp_path, task_args=args)
    proc = subprocess.run(
        [sys.executable, str(EVALS / "summary.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    metrics = {name: m.value for s in log.results.scores for name, m in s.metrics.items()}
    for name, value in metrics.items():
        assert f"{name:>16}: {value:.3f}" in out, out
    for label, n in (("control", 4), ("deceptive", 3), ("honest", 3)):
        assert re.search(rf"mean score {label}: [+-]\d+\.\d\d \(n={n}\)", out), out
    [probe] = tmp_path.glob("*.probe-L2.json")
    assert f"probe: {probe}" in out and f"log:   {log.location}" in out, out
