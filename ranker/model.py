"""The learned length ranker: a small MLP over ``ranker.features``, predicting log length.

Owns fitting (torch, CPU, a few seconds for thousands of prompts), prediction (numpy only, so
a dispatcher needs no torch at run time) and the on-disk form: ``model.safetensors``
(input standardisation and layer weights) plus ``config.json`` (feature spec, layer sizes,
training facts). No pickle anywhere. ``hidden=()`` gives the linear model we measured it
against (docs/ranker.md).

It implements the dispatcher's ``LengthPredictor`` protocol: ``version`` (``None`` until
published) and ``predict(prompts) -> np.ndarray`` of predicted output tokens. Online training
warm-starts from the previous version (``init=``) on a window of recent pairs, so it follows
the policy as its lengths drift. Called by ``ranker.online``, ``ranker.evaluate`` and the
dispatcher.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from ranker.features import FeatureSpec, featurize
from srl.errors import SrlError

if TYPE_CHECKING:
    import torch

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
CLIP = 10.0  # standardised inputs are clipped to ±CLIP in training and prediction alike
BATCH = 256  # pairs per optimizer step in fitting


class RankerError(SrlError):
    """A ranker that cannot be built, read or used."""


# -- fitting, in parts (torch is imported by ``LengthRanker.fit`` only) ----------------------
def standardisation(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature mean and scale of the inputs. A feature constant in training keeps its
    scale (sd 1), so an unseen n-gram at prediction time moves the input by its count, not by
    count / 1e-3; other scales are at least 1e-2."""
    std = x.std(axis=0)
    sd = np.where(std < 1e-6, 1.0, np.maximum(std, 1e-2)).astype(np.float32)
    return x.mean(axis=0), sd


def _layers(
    sizes: list[int], init: LengthRanker | None, out_bias: float, g: torch.Generator
) -> list[torch.nn.Linear]:
    """The MLP's linear layers: ``init``'s weights (a warm start), else Kaiming-uniform weights
    drawn from ``g`` with zero biases and the output bias at the mean target."""
    import torch

    linears = [torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:], strict=False)]
    with torch.no_grad():
        for i, lin in enumerate(linears):
            if init is not None:
                lin.weight.copy_(torch.from_numpy(init.params[f"w{i}"].T.copy()))
                lin.bias.copy_(torch.from_numpy(init.params[f"b{i}"].copy()))
            else:
                torch.nn.init.kaiming_uniform_(lin.weight, a=5**0.5, generator=g)
                lin.bias.zero_()
        if init is None:
            linears[-1].bias.fill_(out_bias)
    return linears


def _train(
    linears: list[torch.nn.Linear],
    xs: torch.Tensor,
    ys: torch.Tensor,
    epochs: int,
    lr: float,
    weight_decay: float,
    g: torch.Generator,
) -> float:
    """AdamW on the MSE of log length, ReLU between the layers, shuffled mini-batches of
    ``BATCH``; returns the last batch's loss."""
    import torch

    mods: list[torch.nn.Module] = []
    for i, lin in enumerate(linears):
        mods.append(lin)
        if i < len(linears) - 1:
            mods.append(torch.nn.ReLU())
    net = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=weight_decay)
    n = len(ys)
    loss_v = float("nan")
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        for s in range(0, n, BATCH):
            idx = perm[s : s + BATCH]
            loss = torch.nn.functional.mse_loss(net(xs[idx])[:, 0], ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
        loss_v = float(loss.detach())
    return loss_v


def _export(linears: list[torch.nn.Linear]) -> dict[str, np.ndarray]:
    """``w{i}`` (in × out, as ``predict_log`` multiplies) and ``b{i}`` of each layer."""
    params: dict[str, np.ndarray] = {}
    for i, lin in enumerate(linears):
        params[f"w{i}"] = lin.weight.detach().numpy().T.copy()
        params[f"b{i}"] = lin.bias.detach().numpy().copy()
    return params


@dataclass
class LengthRanker:
    spec: FeatureSpec
    hidden: tuple[int, ...]
    params: dict[str, np.ndarray]  # mu, sd, then w0, b0, w1, b1, … (float32)
    version: int | None = None
    info: dict[str, Any] = field(default_factory=dict)  # training facts (pairs, loss, …)

    @property
    def layers(self) -> int:
        return len(self.hidden) + 1

    def predict_log(self, x: np.ndarray) -> np.ndarray:
        h = np.clip((x - self.params["mu"]) / self.params["sd"], -CLIP, CLIP)
        for i in range(self.layers):
            h = h @ self.params[f"w{i}"] + self.params[f"b{i}"]
            if i < self.layers - 1:
                np.maximum(h, 0, out=h)
        return h[:, 0].astype(np.float64)

    def predict(self, prompts: Sequence[str]) -> np.ndarray:
        """Predicted output tokens per prompt (float64, at least 1)."""
        if len(prompts) == 0:
            return np.zeros(0)
        return np.maximum(1.0, np.expm1(self.predict_log(featurize(prompts, self.spec))))

    # -- fitting --------------------------------------------------------------------------
    @classmethod
    def fit(
        cls,
        texts: Sequence[str],
        lengths: Sequence[float] | np.ndarray,
        spec: FeatureSpec | None = None,
        hidden: tuple[int, ...] = (64, 32),
        epochs: int = 60,
        lr: float = 2e-3,
        weight_decay: float = 1e-4,
        seed: int = 0,
        init: LengthRanker | None = None,
    ) -> LengthRanker:
        """Fit on (prompt, actual length) pairs; ``init`` warm-starts from a previous version
        (its feature spec, layer sizes and standardisation are kept)."""
        import torch

        y_all = np.asarray(lengths, dtype=np.float64)
        if len(texts) != len(y_all) or len(texts) < 2:
            raise RankerError("ranker: need at least 2 (prompt, length) pairs of equal count")
        if init is not None:
            spec, hidden = init.spec, init.hidden
        spec = spec or FeatureSpec()
        x = featurize(texts, spec)
        y = np.log1p(np.maximum(y_all, 0)).astype(np.float32)
        if init is not None:
            mu, sd = init.params["mu"], init.params["sd"]
        else:
            mu, sd = standardisation(x)
        xs = torch.from_numpy(np.clip((x - mu) / sd, -CLIP, CLIP).astype(np.float32))
        g = torch.Generator().manual_seed(seed)  # the layers' init, then each epoch's order
        linears = _layers([spec.dim, *hidden, 1], init, float(y.mean()), g)
        loss_v = _train(linears, xs, torch.from_numpy(y), epochs, lr, weight_decay, g)
        params = {"mu": mu.astype(np.float32), "sd": sd.astype(np.float32)} | _export(linears)
        info = {
            "pairs": len(y),
            "epochs": epochs,
            "final_batch_mse_log": loss_v,
            "warm_start_from": init.version if init is not None else None,
        }
        return cls(spec, tuple(hidden), params, None, info)

    # -- files ----------------------------------------------------------------------------
    def to_files(self) -> dict[str, bytes]:
        from safetensors.numpy import save

        config = {
            "format": "srl-length-ranker",
            "format_version": 1,
            "features": self.spec.to_dict(),
            "hidden": list(self.hidden),
            "info": self.info,
        }
        return {
            MODEL_FILE: save({k: np.ascontiguousarray(v) for k, v in self.params.items()}),
            CONFIG_FILE: orjson.dumps(config, option=orjson.OPT_INDENT_2),
        }

    @classmethod
    def from_files(cls, files: dict[str, bytes], version: int | None = None) -> LengthRanker:
        from safetensors.numpy import load

        try:
            config = orjson.loads(files[CONFIG_FILE])
            if config.get("format") != "srl-length-ranker":
                raise RankerError(f"ranker: {CONFIG_FILE} is not a length-ranker config")
            spec = FeatureSpec(**config["features"])
            hidden = tuple(int(h) for h in config["hidden"])
            params = load(files[MODEL_FILE])
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError) as e:
            raise RankerError(f"ranker: unreadable model files ({e})") from None
        r = cls(spec, hidden, params, version, dict(config.get("info") or {}))
        need = {"mu", "sd"} | {f"{p}{i}" for i in range(r.layers) for p in "wb"}
        if set(params) != need or params["w0"].shape[0] != spec.dim:
            raise RankerError("ranker: model tensors do not match its config")
        return r

    def with_version(self, version: int) -> LengthRanker:
        return dataclasses.replace(self, version=version)
