"""SAEs in the frontend: the registry of loaded SAEs (`llm.load_sae`, `POST /v1/lens/saes`), checked
against the served model before any worker loads them, and the SAE keys of a request turned into work for
the workers — feature steering becomes an ordinary steering vector (`scale * W_dec[f]` at the point the
decoder writes: the SAE's own, a transcoder's output point; it runs in the graph-safe kernel), features to
return and clamps become `RequestSpec.sae` entries."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from vllm_worker import compat
from vllm_worker.frontend.state import engine_shape, engine_state
from vllm_worker.protocol import points as pts
from vllm_worker.protocol import rpc
from vllm_worker.protocol.checks import finite_number, int_list
from vllm_worker.protocol.spec import (
    SAE_CLAMP_KEY,
    SAE_FEATURES_KEY,
    SAE_STEER_KEY,
    ModelShape,
    RequestSpec,
    Steer,
    from_json_string,
)
from vllm_worker.sae import Sae, load

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass
class LoadedSae:
    name: str
    path: str  # resolved folder
    uid: str  # identity of the files (path, size, mtime): workers and cache salts check it
    sae: Sae  # CPU copy: its decoder rows become steering vectors
    site: int  # where it reads (its features are encoded there)
    out_site: int  # where its decoder writes (steering, clamps): `site` for an SAE, later for a transcoder

    def describe(self) -> dict[str, Any]:
        s = self.sae
        return {
            "name": self.name,
            "path": self.path,
            "hook_name": s.hook_name,
            "point": s.point,
            "layer": s.layer,
            "architecture": s.architecture,
            "d_in": s.d_in,
            "d_sae": s.d_sae,
            "k": s.k or None,
            "kind": "transcoder" if s.transcoder else "sae",
            "hook_name_out": s.hook_name_out or s.hook_name,
            "out_point": s.out_point or s.point,
            "d_out": s.d_out,
        }


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"name: expected 1-64 characters of letters, digits, '_', '.', '-', got {name!r}")
    return name


def files_uid(folder: str) -> str:
    h = hashlib.sha256(folder.encode())
    for f in ("cfg.json", "sae_weights.safetensors"):
        st = os.stat(os.path.join(folder, f))
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def prepare(name: Any, path: Any, shape: ModelShape) -> LoadedSae:
    """Read and check an SAE for this model (ValueError naming the field); nothing is registered yet."""
    name = check_name(name)
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"path: expected the folder of an SAE (cfg.json + sae_weights.safetensors), got {path!r}")
    folder = os.path.realpath(str(path))
    sae = load(folder)
    pts.check_available(sae.point, "hook_name", shape.missing)
    if sae.layer >= shape.n_layers:
        raise ValueError(f"hook_name: layer {sae.layer} is out of range for a model with {shape.n_layers} layers")
    if sae.d_in != shape.d_model:
        raise ValueError(
            f"d_in: SAE {name!r} reads {sae.d_in} values per token, but {sae.point} of this model has "
            f"d_model {shape.d_model}"
        )
    site = pts.canonical_site(sae.point, sae.layer)
    out_site = site
    if sae.out_point is not None:  # a transcoder: the decoder writes another point (hook_name_out)
        pts.check_available(sae.out_point, "hook_name_out", shape.missing)
        if sae.d_out != shape.d_model:
            raise ValueError(
                f"d_out: transcoder {name!r} writes {sae.d_out} values per token, but {sae.out_point} of this "
                f"model has d_model {shape.d_model}"
            )
        out_site = pts.canonical_site(sae.out_point, sae.out_layer)
    return LoadedSae(name, folder, files_uid(folder), sae, site, out_site)


def _items(value: Any, key: str) -> list[tuple[str, Mapping]]:
    value = from_json_string(value, key)
    if isinstance(value, Mapping):
        return [(key, value)]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{key}: expected an object or a non-empty list of objects, got {value!r}")
    out = []
    for i, it in enumerate(value):
        if not isinstance(it, Mapping):
            raise ValueError(f"{key}[{i}]: expected an object, got {type(it).__name__}")
        out.append((f"{key}[{i}]", it))
    return out


def _fields(item: Mapping, f: str, allowed: set[str]) -> None:
    unknown = set(item) - allowed
    if unknown:
        name = sorted(unknown)[0]
        raise ValueError(f"{f}: unknown fields {sorted(unknown)}{pts.closest(name, allowed)}")


def _sae(item: Mapping, f: str, registry: Mapping[str, LoadedSae]) -> LoadedSae:
    name = item.get("sae")
    if not isinstance(name, str):
        raise ValueError(f"{f}.sae: expected the name of a loaded SAE, got {name!r}")
    got = registry.get(name)
    if got is None:
        loaded = ", ".join(sorted(registry)) or "none; load one with llm.load_sae / POST /v1/lens/saes"
        raise ValueError(f"{f}.sae: unknown SAE {name!r}{pts.closest(name, registry)} (loaded: {loaded})")
    return got


def _ids(value: Any, f: str, d_sae: int) -> list[int]:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{f}: expected a non-empty list of feature ids, got {value!r}")
    ids = int_list(value, f, "feature ids")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{f}: duplicate feature ids")
    for i in ids:
        if not 0 <= i < d_sae:
            raise ValueError(f"{f}: feature {i} is out of range for an SAE of {d_sae} features (0..{d_sae - 1})")
    return ids


def _per_feature(value: Any, f: str, n: int) -> list[float]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{f}: expected one number per feature ({n}), got {len(value)}")
        return [float(finite_number(v, f)) for v in value]
    return [float(finite_number(value, f))] * n


def parse(ours: Mapping[str, Any], spec: RequestSpec, shape: ModelShape, registry: Mapping[str, LoadedSae]) -> None:
    """Our SAE keys into `spec` (steers appended, `spec.sae` entries); ValueError naming the field."""
    if SAE_FEATURES_KEY in ours:
        names: set[str] = set()
        for f, item in _items(ours[SAE_FEATURES_KEY], SAE_FEATURES_KEY):
            _fields(item, f, {"sae", "top_k", "features"})
            loaded = _sae(item, f, registry)
            if loaded.name in names:
                raise ValueError(f"{f}.sae: SAE {loaded.name!r} asked for twice (results are keyed by SAE)")
            names.add(loaded.name)
            entry: dict[str, Any] = {"sae": loaded.name, "site": loaded.site, "uid": loaded.uid}
            if ("top_k" in item) == ("features" in item):
                raise ValueError(f"{f}: give exactly one of top_k (the k strongest features) or features (ids)")
            if "top_k" in item:
                k = item["top_k"]
                if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= loaded.sae.d_sae:
                    raise ValueError(f"{f}.top_k: expected an int in 1..{loaded.sae.d_sae} (d_sae), got {k!r}")
                entry["top_k"] = k
            else:
                entry["ids"] = _ids(item["features"], f"{f}.features", loaded.sae.d_sae)
            spec.sae.append(entry)
    if SAE_STEER_KEY in ours:
        for f, item in _items(ours[SAE_STEER_KEY], SAE_STEER_KEY):
            _fields(item, f, {"sae", "features", "scale"})
            loaded = _sae(item, f, registry)
            ids = _ids(item.get("features"), f"{f}.features", loaded.sae.d_sae)
            scales = _per_feature(item.get("scale", 1.0), f"{f}.scale", len(ids))
            vec = (torch.tensor(scales).unsqueeze(1) * loaded.sae.W_dec[ids]).sum(0, keepdim=True)
            spec.steers.append(Steer([loaded.out_site], vec, None, 1.0, False))
    if SAE_CLAMP_KEY in ours:
        for f, item in _items(ours[SAE_CLAMP_KEY], SAE_CLAMP_KEY):
            _fields(item, f, {"sae", "features", "values"})
            loaded = _sae(item, f, registry)
            ids = _ids(item.get("features"), f"{f}.features", loaded.sae.d_sae)
            if "values" not in item:
                raise ValueError(f"{f}.values: needed (the activation each feature is set to)")
            values = _per_feature(item["values"], f"{f}.values", len(ids))
            spec.sae.append(
                {
                    "sae": loaded.name,
                    "site": loaded.site,
                    "uid": loaded.uid,
                    "ids": ids,
                    "values": values,
                    "clamp": True,
                    **({"out_site": loaded.out_site} if loaded.out_site != loaded.site else {}),
                }
            )


# ---------------------------------------------------------------- offline `vllm.LLM` methods


def load_sae(self: Any, name: str, path: str) -> dict[str, Any]:
    """Load an SAE (SAELens format folder) under `name` in every worker; a request names it in
    `output_sae_features` / `apply_sae_steering` / `apply_sae_clamp`. Loading a name again replaces it."""
    loaded = prepare(name, path, engine_shape(compat.processor_of_llm(self)))
    compat.rpc(self, rpc.LOAD_SAE, loaded.name, loaded.path, loaded.uid)
    engine_state(self).saes[loaded.name] = loaded
    return loaded.describe()


def list_saes(self: Any) -> list[dict[str, Any]]:
    return [s.describe() for s in engine_state(self).saes.values()]


METHODS: dict[str, Any] = {"load_sae": load_sae, "list_saes": list_saes}
