"""Head weights from sink-isolated collision (Renyi-2) entropy, and group pooling.

Shapes: L eligible layers, H query heads, G = H / r KV heads, n key positions.
All functions are vectorized over (layer, head); no Python loop over tokens.
"""
from __future__ import annotations

import numpy as np


def isolate_sinks(s: np.ndarray, sinks: int) -> tuple[np.ndarray, np.ndarray]:
    """p [L, H, n]: s renormalized over the non-sink keys (0 on sinks), and
    flagged [L, H] bool: heads with no mass outside the sinks (they get the uniform
    distribution over non-sink keys)."""
    s = np.asarray(s, dtype=np.float64)
    n = s.shape[-1]
    k = min(sinks, n)
    p = s.copy()
    p[..., :k] = 0.0
    mass = p.sum(axis=-1, keepdims=True)
    flagged = mass[..., 0] <= 0.0
    if n > k:
        uniform = np.zeros(n)
        uniform[k:] = 1.0 / (n - k)
        p = np.where(mass > 0.0, p / np.where(mass > 0.0, mass, 1.0), uniform)
    return p, flagged


def normalize(s: np.ndarray) -> np.ndarray:
    """p [L, H, n] over all keys, sinks included (the no-isolation ablation)."""
    s = np.asarray(s, dtype=np.float64)
    mass = s.sum(axis=-1, keepdims=True)
    return s / np.where(mass > 0.0, mass, 1.0)


def collision(p: np.ndarray) -> np.ndarray:
    """c [L, H] = <p, p>; the collision entropy is H2 = -log c."""
    return np.einsum("lhn,lhn->lh", p, p)


def head_weights(c: np.ndarray, r: int, tau: float = 1.0) -> np.ndarray:
    """w [L, H]: softmax of -H2 / tau within each group of r consecutive query heads
    (query head h reads KV head h // r); tau = 1 gives w = c / sum_group c."""
    L, H = c.shape
    logits = np.log(np.maximum(c, np.finfo(np.float64).tiny)) / tau   # -H2 / tau
    g = logits.reshape(L, H // r, r)
    g = np.exp(g - g.max(axis=-1, keepdims=True))
    return (g / g.sum(axis=-1, keepdims=True)).reshape(L, H)


def pool(p: np.ndarray, w: np.ndarray, r: int) -> np.ndarray:
    """S [L, G, n] = sum over the heads h of group g of w[l, h] * p[l, h]."""
    L, H, n = p.shape
    return np.einsum("lgrn,lgr->lgn", p.reshape(L, H // r, r, n), w.reshape(L, H // r, r))


def sink_mass(s: np.ndarray, sinks: int) -> np.ndarray:
    """[L, H]: share of each head's window attention that lands on the sink positions."""
    s = np.asarray(s, dtype=np.float64)
    tot = s.sum(axis=-1)
    return s[..., :sinks].sum(axis=-1) / np.where(tot > 0, tot, 1.0)


def masquerade_ratio(s: np.ndarray, sinks: int, r: int, tau: float = 1.0) -> np.ndarray:
    """[L, H]: weight without sink isolation / weight with isolation."""
    w_iso = head_weights(collision(isolate_sinks(s, sinks)[0]), r, tau)
    w_raw = head_weights(collision(normalize(s)), r, tau)
    return w_raw / np.maximum(w_iso, np.finfo(np.float64).tiny)
