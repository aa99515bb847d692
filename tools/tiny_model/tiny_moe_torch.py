"""The tiny qwen3moe language model in torch, computed the way llama.cpp computes it.

One module, shared by training (tools/tiny_model/train_tiny_moe.py), export
(tools/tiny_model/export_tiny_moe.py) and verification (tools/tiny_model/verify_tiny_moe.py,
tests/slow/test_tiny_model.py). The forward pass follows
llama.cpp's ``llama_model_qwen3moe::graph`` and ``llm_graph_context::build_moe_ffn``:

- x = token_embd[ids]
- per layer il:
  h = rms_norm(x) * attn_norm
  q, k, v = wq h, wk h, wv h split into heads (GQA: n_head_kv <= n_head)
  q, k = rms_norm over each head's dims * attn_q_norm / attn_k_norm
  q, k = rope NEOX style (first half / second half of each head rotate together)
  x = x + wo causal_softmax(q k^T / sqrt(head_dim)) v
  h = rms_norm(x) * ffn_norm
  probs = softmax(ffn_gate_inp h)             (over n_expert)
  ids = top-k(probs), w = probs[ids] / sum(probs[ids])     (norm_w = true)
  x = x + sum_k w_k * down_k(silu(gate_k h) * up_k h)      (no shared expert)
- logits = output(rms_norm(x) * output_norm), output tied to token_embd.

Tensor shapes in torch are [out, in] as in nn.Linear; the expert stacks are
[n_expert, out, in], which is the numpy layout of ggml's
``ffn_{gate,up}_exps`` ne=[n_embd, n_ff_exp, n_expert] and ``ffn_down_exps``
ne=[n_ff_exp, n_embd, n_expert]. This module does not import gguf.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TinyMoeConfig:
    n_vocab: int = 4096
    n_embd: int = 256
    n_layer: int = 8
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64  # n_embd_head_k == n_embd_head_v == n_rot
    n_expert: int = 32
    n_expert_used: int = 4
    n_ff_exp: int = 64
    n_ctx_train: int = 512  # tokens
    rope_freq_base: float = 10000.0
    rms_norm_eps: float = 1e-6

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


class RMSNorm(nn.Module):
    """llama.cpp ggml_rms_norm followed by the elementwise weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_neox(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """ggml_rope_ext with GGML_ROPE_TYPE_NEOX: dim i pairs with dim i + head_dim/2.

    x: [batch, n_tokens, n_heads, head_dim]; pos: [n_tokens] (token positions).
    """
    half = x.shape[-1] // 2
    inv_freq = base ** (-torch.arange(0, half, dtype=torch.float32, device=x.device) / half)
    theta = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [n_tokens, half] (radians)
    cos = theta.cos()[None, :, None, :]
    sin = theta.sin()[None, :, None, :]
    x0, x1 = x[..., :half], x[..., half:]
    return torch.cat((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TinyMoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wq = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.n_embd, cfg.n_head_kv * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.n_embd, cfg.n_head_kv * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, t, cfg.n_head, cfg.head_dim))
        k = self.k_norm(self.wk(x).view(b, t, cfg.n_head_kv, cfg.head_dim))
        v = self.wv(x).view(b, t, cfg.n_head_kv, cfg.head_dim)
        q = rope_neox(q, pos, cfg.rope_freq_base).transpose(1, 2)  # [b, n_head, t, head_dim]
        k = rope_neox(k, pos, cfg.rope_freq_base).transpose(1, 2)
        v = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(cfg.head_dim), enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, cfg.n_head * cfg.head_dim))


class MoeFfn(nn.Module):
    """build_moe_ffn with LLM_FFN_SILU, norm_w = true, softmax gating, no shared expert."""

    def __init__(self, cfg: TinyMoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        e, d, f = cfg.n_expert, cfg.n_embd, cfg.n_ff_exp
        self.gate_inp = nn.Linear(d, e, bias=False)  # ffn_gate_inp
        self.gate_exps = nn.Parameter(torch.empty(e, f, d))  # ffn_gate_exps
        self.up_exps = nn.Parameter(torch.empty(e, f, d))  # ffn_up_exps
        self.down_exps = nn.Parameter(torch.empty(e, d, f))  # ffn_down_exps
        nn.init.normal_(self.gate_exps, std=d**-0.5)
        nn.init.normal_(self.up_exps, std=d**-0.5)
        nn.init.normal_(self.down_exps, std=f**-0.5)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [n_tokens, n_embd] -> probs [n_tokens, n_expert], ids and weights [n_tokens, n_expert_used]."""
        probs = torch.softmax(self.gate_inp(h).float(), dim=-1)
        top_p, ids = torch.topk(probs, self.cfg.n_expert_used, dim=-1)
        # llama.cpp clamps the sum at the smallest normal F16 value before dividing.
        weights = top_p / top_p.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
        return probs, ids, weights

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h: [..., n_embd] -> (out [..., n_embd], probs [n_tokens, n_expert], ids [n_tokens, k])."""
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        probs, ids, weights = self.route(h)
        n_tokens, k = ids.shape
        flat_ids = ids.reshape(-1)  # [n_tokens * k]
        order = torch.argsort(flat_ids, stable=True)
        token_of = order // k  # token index of each sorted (token, slot) pair
        counts = torch.bincount(flat_ids, minlength=self.cfg.n_expert).tolist()
        xs = h[token_of]  # [n_tokens * k, n_embd], grouped by expert
        ws = weights.reshape(-1)[order].unsqueeze(-1)
        # unbind (not indexing) so that backward writes each stack's gradient once, not
        # one zero-filled full-size gradient per expert.
        gates, ups, downs = self.gate_exps.unbind(0), self.up_exps.unbind(0), self.down_exps.unbind(0)
        outs = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            x_e = xs[start : start + n]
            a = F.silu(x_e @ gates[e].t()) * (x_e @ ups[e].t())
            outs.append(a @ downs[e].t())
            start += n
        y = torch.cat(outs) * ws
        out = torch.zeros_like(h).index_add_(0, token_of, y.to(h.dtype))
        return out.reshape(shape), probs, ids


class Block(nn.Module):
    def __init__(self, cfg: TinyMoeConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        self.moe = MoeFfn(cfg)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), pos)
        moe_out, probs, ids = self.moe(self.ffn_norm(x))
        return x + moe_out, probs, ids


class TinyMoe(nn.Module):
    def __init__(self, cfg: TinyMoeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_embd = nn.Embedding(cfg.n_vocab, cfg.n_embd)
        nn.init.normal_(self.token_embd.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.output_norm = RMSNorm(cfg.n_embd, cfg.rms_norm_eps)
        # Residual-branch output projections start small (GPT-2 style 1/sqrt(2 n_layer)).
        for block in self.blocks:
            nn.init.normal_(block.attn.wo.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.normal_(block.moe.down_exps, std=0.02 / math.sqrt(2 * cfg.n_layer))
            nn.init.normal_(block.moe.gate_inp.weight, std=0.02)

    def forward(
        self, tokens: torch.Tensor, pos0: int = 0
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """tokens: [batch, n_tokens] -> logits [batch, n_tokens, n_vocab] and per layer
        router probs [batch * n_tokens, n_expert] and selected ids [batch * n_tokens, n_expert_used]."""
        pos = torch.arange(pos0, pos0 + tokens.shape[1], device=tokens.device)
        x = self.token_embd(tokens)
        all_probs: list[torch.Tensor] = []
        all_ids: list[torch.Tensor] = []
        for block in self.blocks:
            x, probs, ids = block(x, pos)
            all_probs.append(probs)
            all_ids.append(ids)
        logits = self.output_norm(x) @ self.token_embd.weight.t()  # output tied to token_embd
        return logits, all_probs, all_ids


def load_balancing_loss(probs: torch.Tensor, ids: torch.Tensor, n_expert: int) -> torch.Tensor:
    """Switch-Transformer / Qwen-MoE auxiliary loss: n_expert * sum_e f_e * P_e.

    f_e is the fraction of the n_tokens * k routing slots that chose expert e, P_e the
    mean router probability of e. It equals 1 for perfectly uniform routing.
    """
    f = torch.bincount(ids.reshape(-1), minlength=n_expert).to(probs.dtype) / ids.numel()
    return n_expert * torch.sum(f * probs.mean(0))
