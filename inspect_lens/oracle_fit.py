"""Fit a tiny activation oracle: a LoRA that answers "what topic did this activation come from?" about an
activation vector injected into its own forward pass (peft + HF transformers, on CPU).

    from inspect_lens.oracle_fit import ensure_oracle, fit_oracle
    fit_oracle(model_dir, out_dir)            # always fits (replaces an oracle already there)
    ensure_oracle(out_dir, model_dir)         # fits only when `out_dir` holds no oracle yet (cached)

`examples/activation_oracle_fit.py` is the command line over `fit_oracle`; `evals/activation_oracle.py`
calls `ensure_oracle` so the eval fits its oracle on first use (~10 min for SmolLM2 on 2 CPU cores).

Data, made here from the base model's own activations: templated sentences about 8 topics
(`inspect_lens.oracle_data`; whole templates are held out for evaluation). Each sentence is a user
message in the chat template; its residual stream after the source layer (the middle one by default),
averaged over the sentence's tokens, is what the oracle reads — as the `activation_oracle` solver
reads a conversation with `positions="mean"`. The oracle prompt is the chat template of

    Layer: {L}
     ?
    What is the topic of the text? Answer with one word.

and the vector is added at the placeholder " ?" after layer 1 exactly as vLLM's steering does it with
`SteeringVector(v[None, None], [1], scale=1, norm_match=True, position_indices=[pos])`:
h <- h + |h| v/|v|. The LoRA (rank 8 on every projection) is trained with the loss on the answer
tokens only. Saved (atomically: written to a temporary folder beside the target, then renamed): a
standard peft adapter folder plus `oracle.json` (source layer, injection layer, placeholder, question,
topics, held-out accuracy). Held-out accuracy is measured with the real vector, with the vectors
shuffled across samples, and with no vector — the gap is the evidence that the oracle reads the
activation rather than guessing.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

from .oracle_data import PLACEHOLDER, QUESTION, TOPICS, oracle_ids, oracle_prompt, text_window, topic_texts

log = logging.getLogger(__name__)

STEPS, BATCH, LR, RANK, SEED = 150, 8, 2e-3, 8, 0  # the defaults (the shipped oracle was fitted with these)


def make_samples() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held out) lists of (text, topic); held-out uses templates never seen in training."""
    return topic_texts(held_out=False), topic_texts(held_out=True)


def _bar(iterable: Any = None, *, total: int | None = None, desc: str, progress: bool) -> Any:
    from tqdm.auto import tqdm

    # disable=None: drawn on a terminal only (no bar in captured output or CI logs)
    return tqdm(iterable, total=total, desc=desc, leave=False, disable=None if progress else True, dynamic_ncols=True)


@torch.no_grad()
def source_vectors(model, tok, texts: list[str], layer: int, progress: bool = False) -> torch.Tensor:
    """(n, d): the stream after `layer`, averaged over each text's tokens inside the chat template — the
    same numbers vLLM's capture gives the solver (`positions="mean"`)."""
    out = []
    for text in _bar(texts, desc=f"oracle: reading layer {layer}", progress=progress):
        ids, (a, b) = text_window(tok, text)
        hs = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False).hidden_states[layer + 1]
        out.append(hs[0, a:b].mean(0).float())
    return torch.stack(out)


class Injector:
    """Forward hook on decoder layer 1: h[pos] += |h[pos]| v/|v| per batch row (vLLM's norm_match)."""

    def __init__(self, layer_module: torch.nn.Module) -> None:
        self.vectors: torch.Tensor | None = None  # (B, d) or None (no injection)
        self.positions: list[int] = []
        layer_module.register_forward_hook(self)

    def __call__(self, mod, args, out):
        if self.vectors is None:
            return None
        h = out[0] if isinstance(out, tuple) else out
        rows = torch.arange(h.shape[0])
        pos = torch.tensor(self.positions)
        cur = h[rows, pos]
        v = self.vectors.to(h.dtype)
        add = cur.norm(dim=-1, keepdim=True) * v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        h = h.index_put((rows, pos), cur + add)
        return (h,) + tuple(out[1:]) if isinstance(out, tuple) else h


def encode(tok, source_layer: int, answer: str | None, placeholder: str = PLACEHOLDER) -> tuple[list[int], int, int]:
    """(ids, placeholder position, number of prompt tokens) for the oracle prompt (+ answer if given)."""
    prompt, pos = oracle_ids(tok, source_layer, QUESTION, placeholder)
    ids = prompt + (tok.encode(answer + tok.eos_token, add_special_tokens=False) if answer else [])
    return ids, pos, len(prompt)


def answer_logprobs(
    model, tok, inj: Injector, source_layer: int, vectors: torch.Tensor | None, placeholder: str = PLACEHOLDER
) -> torch.Tensor:
    """(n, n_topics): log p(topic answer | oracle prompt with each vector injected)."""
    topics = list(TOPICS)
    base, pos, n_prompt = encode(tok, source_layer, None, placeholder)
    cands = [tok.encode(t + tok.eos_token, add_special_tokens=False) for t in topics]
    n = 1 if vectors is None else len(vectors)
    scores = torch.zeros(n, len(topics))
    with torch.no_grad():
        for k, cand in enumerate(cands):
            ids = torch.tensor([base + cand] * n)
            inj.vectors, inj.positions = vectors, [pos] * n
            logits = model(ids, use_cache=False).logits.float().log_softmax(-1)
            tgt = ids[:, n_prompt:]
            scores[:, k] = logits[:, n_prompt - 1 : -1].gather(-1, tgt.unsqueeze(-1)).squeeze(-1).sum(-1)
    inj.vectors = None
    return scores


def n_layers_of(model: str | Path) -> int:
    """Decoder layers of an HF model (folder or hub id), from its config alone."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model))
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(cfg.num_hidden_layers)


def default_oracle_dir(model: str | Path, source_layer: int | None = None) -> Path:
    """`<user cache>/inspect-lens/oracles/<model folder name>-topic-L<layer>` (layer: the middle one)."""
    from vllm_worker.shipped_model import cache_root

    layer = n_layers_of(model) // 2 if source_layer is None else source_layer
    return cache_root() / "oracles" / f"{Path(str(model)).name}-topic-L{layer}"


def _check_target(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"oracle: {out} is a file, not an adapter folder")
    if out.is_dir() and not (out / "oracle.json").exists() and any(out.iterdir()):
        raise ValueError(
            f"oracle: {out} exists, is not empty and holds no oracle.json: not an oracle folder "
            "(give an empty or new folder)"
        )


def _check_placeholder(tok, source_layer: int, placeholder: str) -> None:
    """The solver needs the placeholder to be one token that stays one token in the oracle prompt: refuse
    before training, not after."""
    ph = tok.encode(placeholder, add_special_tokens=False)
    ids, pos = oracle_ids(tok, source_layer, QUESTION, placeholder)
    if len(ph) != 1 or ids[pos] != ph[0]:
        raise ValueError(
            f"placeholder {placeholder!r} is {len(ph)} token(s) {ph} for this tokenizer (or merges with "
            "its neighbours in the oracle prompt); it must be one token: pick another placeholder "
            "(e.g. ' the')"
        )


def fit_oracle(
    model: str | Path | None = None,
    out: str | Path | None = None,
    *,
    source_layer: int | None = None,
    steps: int = STEPS,
    batch: int = BATCH,
    lr: float = LR,
    rank: int = RANK,
    seed: int = SEED,
    placeholder: str = PLACEHOLDER,
    replace: bool = True,
    progress: bool = True,
    echo: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Fit an oracle on `model` (an HF folder or hub id; default: the shipped SmolLM2) and save it to `out`
    (default: `default_oracle_dir(model, layer)`). `source_layer`: the layer read (default: the middle one);
    `placeholder`: where the vector goes (must be one token). Written to a temporary folder beside `out`,
    then renamed into place; an oracle already at `out` is replaced if `replace`, else kept (another
    process fitted it first). `progress`: tqdm bars on a terminal; `echo`: called with a line per 10
    training steps. Returns `oracle.json`'s content (held-out accuracy included) plus `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        from vllm_worker.shipped_model import shipped_model_path

        model = shipped_model_path()
    model_dir = str(model)
    if steps < 1 or batch < 1:
        raise ValueError(f"fit_oracle: steps and batch must be >= 1 (got steps={steps}, batch={batch})")
    torch.manual_seed(seed)
    rng = random.Random(seed)
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    except OSError as e:
        raise ValueError(
            f"oracle: cannot load the base model {model_dir!r} with transformers ({e}); give its HF folder"
        ) from e
    n_layers = base.config.num_hidden_layers
    layer = n_layers // 2 if source_layer is None else source_layer
    if not 0 <= layer < n_layers:
        raise ValueError(f"source_layer: {layer} is not a layer of {model_dir} (0..{n_layers - 1})")
    out = Path(out).expanduser() if out is not None else default_oracle_dir(model_dir, layer)
    _check_target(out)
    _check_placeholder(tok, layer, placeholder)

    train, test = make_samples()
    topics = list(TOPICS)
    v_train = source_vectors(base, tok, [t for t, _ in train], layer, progress)
    v_test = source_vectors(base, tok, [t for t, _ in test], layer, progress)
    y_test = torch.tensor([topics.index(c) for _, c in test])

    peft_model = get_peft_model(
        base,
        LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    )
    inj = Injector(peft_model.base_model.model.model.layers[1])
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    encoded = [encode(tok, layer, topic, placeholder) for _, topic in train]
    peft_model.train()
    bar = _bar(total=steps, desc="oracle: training", progress=progress)
    try:
        for step in range(steps):
            idx = rng.sample(range(len(train)), min(batch, len(train)))
            width = max(len(encoded[i][0]) for i in idx)
            ids = torch.full((len(idx), width), tok.pad_token_id or 0)
            labels = torch.full((len(idx), width), -100)
            for r, i in enumerate(idx):
                seq, _, n_prompt = encoded[i]
                ids[r, : len(seq)] = torch.tensor(seq)
                labels[r, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])
            inj.vectors, inj.positions = v_train[idx], [encoded[i][1] for i in idx]
            loss = peft_model(ids, labels=labels, use_cache=False).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if echo is not None and (step % 10 == 0 or step == steps - 1):
                echo(f"step {step:4d}  loss {loss.item():.3f}")
    finally:
        bar.close()
    peft_model.eval()
    inj.vectors = None
    perm = torch.randperm(len(v_test), generator=torch.Generator().manual_seed(seed + 1))
    results = {}
    for name, vecs in _bar(
        (("real", v_test), ("shuffled", v_test[perm]), ("none", None)), desc="oracle: held-out check", progress=progress
    ):
        scores = answer_logprobs(peft_model, tok, inj, layer, vecs, placeholder)
        pred = scores.argmax(-1)
        pred = pred.expand(len(y_test)) if vecs is None else pred
        results[name] = float((pred == y_test).float().mean())
    meta = {
        "base_model": model_dir,
        "source_layer": layer,
        "injection_layer": 1,
        "placeholder": placeholder,
        "question": QUESTION,
        "prompt": oracle_prompt(layer, placeholder=placeholder),
        "topics": topics,
        "vector": "mean over the text's tokens (user message, chat template)",
        "held_out_accuracy": results,
        "chance": 1 / len(topics),
        "steps": steps,
        "held_out_texts": len(test),
    }

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()  # (not mkdtemp: its 0700 would stick to the published folder)
    try:
        peft_model.save_pretrained(str(tmp))
        (tmp / "oracle.json").write_text(json.dumps(meta, indent=1))
        if not _publish(tmp, out, replace):
            log.warning("inspect-lens: an oracle appeared at %s while this one was fitted; keeping that one", out)
            meta = json.loads((out / "oracle.json").read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {**meta, "path": str(out)}


def _publish(tmp: Path, out: Path, replace: bool) -> bool:
    """Rename `tmp` to `out` (absent or empty); an oracle already at `out`: replaced if `replace`, else
    kept (returns False)."""
    try:
        os.rename(tmp, out)  # atomic; also replaces an empty folder
        return True
    except OSError:
        if not (out / "oracle.json").exists():
            raise
        if not replace:
            return False
    old = out.parent / f".{out.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return True


def ensure_oracle(path: str | Path, model: str | Path, **fit_args: Any) -> Path:
    """`path` if it holds an oracle (`oracle.json`); otherwise fit one there on `model` first (`fit_oracle`'s
    arguments, e.g. `source_layer`, `steps`, `placeholder`) — the oracle is cached for later runs."""
    path = Path(path).expanduser()
    if (path / "oracle.json").exists():
        return path
    _check_target(path)
    args = {k: v for k, v in fit_args.items() if v is not None}
    log.warning(
        "inspect-lens: no activation oracle at %s yet; fitting one on %s (%s steps, peft on CPU; SmolLM2-135M "
        "takes ~10 min on 2 idle cores); it is cached there for later runs",
        path,
        model,
        args.get("steps", STEPS),
    )
    meta = fit_oracle(model, path, replace=False, echo=lambda line: log.info("inspect-lens: oracle %s", line), **args)
    acc = ", ".join(f"{k} vector {v:.3f}" for k, v in meta["held_out_accuracy"].items())
    log.warning(
        "inspect-lens: fitted the activation oracle (source layer %d; held-out accuracy: %s); saved to %s",
        meta["source_layer"],
        acc,
        path,
    )
    return path


def served_base_model(model: Any) -> str | None:
    """The base model folder behind an Inspect `vllm-lens/<name>` model: `<name>` itself when it is a folder,
    else the `root` the server reports for it in `/v1/models` (a `vllm-lens serve DIR --served-model-name
    NAME` given by `--model-base-url`) when that is a folder. None when neither is found (a hub id, a server
    that is not reachable, another provider)."""
    from . import _compat

    api = getattr(model, "api", None)
    name = _compat.base_model(api) if api is not None else None
    if not name:
        return None
    if Path(name).expanduser().is_dir():
        return str(Path(name).expanduser())
    url = _compat.init_base_url(api) or os.environ.get("VLLM_BASE_URL")
    if not url:
        return None
    import httpx

    key = getattr(api, "api_key", None)
    try:
        resp = httpx.get(
            str(url).rstrip("/").removesuffix("/v1") + "/v1/models",
            timeout=30,
            headers={"Authorization": f"Bearer {key}"} if key else {},
        )
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        log.warning("inspect-lens: could not ask %s which model it serves: %s", url, e)
        return None
    root = next((c.get("root") for c in cards if c.get("id") == name), None)
    return str(Path(root).expanduser()) if root and Path(root).expanduser().is_dir() else None


def evaluated_base_model() -> str | None:
    """`served_base_model` of the model the current eval runs with (Inspect makes it the active model before
    it builds the tasks); None when there is none (e.g. a task built outside `eval()`)."""
    from inspect_ai.model import get_model

    try:
        model = get_model()  # the active model, else $INSPECT_EVAL_MODEL
    except ValueError:  # no model at all
        return None
    return served_base_model(model)
