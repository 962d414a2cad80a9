"""The hand-initialised circuit of `kvguard-tiny`, and which weights training may change.

Lifecycle: `build_model(seed)` returns a `TinyLlama` whose circuit weights are set by hand and
whose other weights are small random values; `trainable_masks(model)` says, per parameter, which
entries training may update (1) and which belong to the circuit (0). Training multiplies gradients
by the masks, so the circuit it starts from is bit-for-bit still there at the end.

Residual stream (hidden size 200; the rest is free for learned features):
- `CONST` a constant every embedding carries; `FLAG` set only by BOS;
- `TOK` a 14-dim code of the current byte (`token_codes`: unit vectors with low mutual
  coherence) and `SHORT` its 7-dim bucket code (one-hot of id mod 7); BOS has neither;
- `prev_slot(k)` the code of the byte k back (k = 1..5 and 32), `short_slot(k)` its bucket code
  (k = 5..9), `PREV_BOS` 1 when the previous token is BOS (layer 0 writes these);
- `JUNK` about 1 on a token that never follows real text ('<' not at a line start, BOS, EOS, PAD
  or NUL in the middle of a sequence): what a stale or corrupted KV cache looks like;
- `COPY` the code of the byte the loose copy head copies, `CONF` / `CONF5` how firmly the
  loose / strict copy head matched (about 1, or 0 when it fell back to BOS), `SEEN` 1 when a
  canary marker (`CNRY-`) occurs anywhere in the context, `END` 1 when the current byte is the
  last of a marker (its body began exactly 31 bytes back).

Layer 0 (all circuit): ten positional heads; head h attends exactly HEAD_OFFSETS[h] back (BOS
when there is no such position) and writes that byte's codes. Keys are one constant vector on the
12 fastest RoPE pairs, queries the same vector rotated back by the offset, with amplitudes
(`positional_amplitudes`) that keep every wrong distance up to the window >= 21% below the peak.
The MLP computes `JUNK`.

Layer 1, KV group 0 (circuit): the key of position s is its 9-byte window (the 5 previous bytes
by full code, weight 1, and the 4 before by bucket, weight 0.35) on the 103 slowest RoPE dims,
which turn by under 0.3 rad across 8,192 positions, plus a sink dim (BOS only) and a gate dim
(all but BOS); the value is the byte's code and a confidence dim. Head 0 (loose copy) queries
with the current window: the score counts matching bytes, BOS scores 4.5, so the head copies the
byte that followed the best earlier occurrence of the last bytes when at least the 5 recent ones
match, and copies nothing otherwise. Head 1 (strict) only reports when all 9 match. Head 2 looks
for the window `CNRY-` and reports `SEEN`; head 3 wants that window exactly 31 bytes back (group
0's keys also carry a positional part on the fast RoPE pairs for it) and reports `END`. Head 4
(group 0) and heads 5-9 (group 1), the MLP of layer 1, the final norm and the LM head are learned;
the LM head starts by reading `COPY` (a copied newline becomes EOS: answers are single lines)
and turns `END` into EOS (that column is frozen). `END` belongs to the circuit alone: no learned
weight writes into it (the learned heads' output rows and the layer-1 MLP's are zero there) or
rescales it (the final norm's entry stays 1), so a marker's last byte always ends the answer.
Run 3 let training write there, and its MLP learned to cancel `END` where a `Repeat exactly:`
text goes on after a marker; on long contexts it also did so after a reference answer (2% of
4,096-byte copies ran on past the marker).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from backend.bundled.modeling import Layer, TinyConfig, TinyLlama

CODE_DIM, SHORT_DIM = 14, 7
CONST, FLAG, CONF, CONF5, PREV_BOS, JUNK, SEEN, END = range(8)
TOK = slice(8, 8 + CODE_DIM)
SHORT = slice(TOK.stop, TOK.stop + SHORT_DIM)
FULL_OFFSETS = (1, 2, 3, 4, 5, 32)
SHORT_OFFSETS = (5, 6, 7, 8, 9)
HEAD_OFFSETS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 32)
RECENT, OLDER, OLDER_WEIGHT = 5, 4, 0.35
CONST_VALUE = 2.0
POSITIONAL_PEAK = 160.0  # layer-0 score at the right distance
BOS_SCORE = 140.0  # layer-0 score of BOS: above every wrong distance, below the right one
MATCH_UNIT = 40.0  # layer-1 score per matching recent byte
LOOSE_THRESHOLD, STRICT_THRESHOLD, SEEN_THRESHOLD = 4.5, 6.2, 4.0
END_DISTANCE = 31  # from a marker's first body byte to its last
END_PEAK = 200.0  # the END head's positional score at END_DISTANCE (5 matching bytes score 200)
END_THRESHOLD = 5.0 + 0.9 * END_PEAK / MATCH_UNIT  # both the window and the distance must fit
COPY_LOGIT = 12.0  # LM-head logit of the copied byte
END_LOGIT = 25.0  # LM-head logit of EOS when a marker just ended
JUNK_GAIN = 40.0
JUNK_IDS = (ord("<"), 257, 258, 0)  # with BOS (by FLAG): never inside real text
LEARNED_STD = 0.02
NEWLINE = 10
MARKER_START = "CNRY-"
_FIRST_PREV = SHORT.stop


def prev_slot(offset: int) -> slice:
    start = _FIRST_PREV + CODE_DIM * FULL_OFFSETS.index(offset)
    return slice(start, start + CODE_DIM)


def short_slot(offset: int) -> slice:
    start = _FIRST_PREV + CODE_DIM * len(FULL_OFFSETS) + SHORT_DIM * SHORT_OFFSETS.index(offset)
    return slice(start, start + SHORT_DIM)


COPY = slice(short_slot(9).stop, short_slot(9).stop + CODE_DIM)
# squared norms of the residual stream (BOS's embedding is padded to a byte's norm)
_SQ_EMBED = CONST_VALUE**2 + 2.0
_SQ_LAYER1 = _SQ_EMBED + len(FULL_OFFSETS) + len(SHORT_OFFSETS)
_SQ_BOS_LAYER1 = _SQ_EMBED + 1.0  # BOS at layer 1: no codes around it, but PREV_BOS = 1
_SQ_FINAL = _SQ_LAYER1 + 5.0


def _rms(sq_norm: float, c: TinyConfig) -> float:
    return math.sqrt(sq_norm / c.hidden_size)


@torch.enable_grad()
def token_codes(c: TinyConfig, seed: int) -> torch.Tensor:
    """[vocab, 14] unit codes with low mutual coherence; BOS gets the zero vector."""
    gen = torch.Generator().manual_seed(seed)
    n = c.vocab_size - 1
    z = torch.randn(n, CODE_DIM, generator=gen, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.01)
    off_diag = ~torch.eye(n, dtype=torch.bool)
    for _ in range(400):
        u = z / z.norm(dim=1, keepdim=True)
        loss = torch.logsumexp(24.0 * (u @ u.T)[off_diag].abs(), 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    codes = torch.zeros(c.vocab_size, CODE_DIM)
    others = [i for i in range(c.vocab_size) if i != c.bos_id]
    codes[others] = (z / z.norm(dim=1, keepdim=True)).detach().float()
    return codes


def bucket_codes(c: TinyConfig) -> torch.Tensor:
    """[vocab, 7] one-hot of (id mod 7): different bytes score 0 unless they share a bucket."""
    codes = torch.zeros(c.vocab_size, SHORT_DIM)
    codes[torch.arange(c.vocab_size), torch.arange(c.vocab_size) % SHORT_DIM] = 1.0
    codes[c.bos_id] = 0.0
    return codes


@functools.cache
@torch.enable_grad()
def positional_amplitudes(c: TinyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index, amplitude r with sum 1) on the fast RoPE pairs, maximising the margin.

    Score(d) = sum_j r_j cos(d * theta_j) is 1 at d = 0; the optimisation pushes the largest value
    at every other d in [-40, window] as low as it goes (about 0.78).
    """
    inv = c.inv_freq().double()
    pairs = torch.nonzero(inv * c.max_position_embeddings > 0.5).flatten()
    d = torch.arange(-40, c.max_position_embeddings + 1, dtype=torch.float64)
    one_minus_cos = 1 - torch.cos(d[d != 0][:, None] * inv[pairs][None, :])
    z = torch.zeros(len(pairs), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([z], lr=0.05)
    for _ in range(1500):
        gap = (torch.softmax(z, 0)[None, :] * one_minus_cos).sum(1)
        loss = torch.logsumexp(-200.0 * gap, 0) / 200.0
        opt.zero_grad()
        loss.backward()
        opt.step()
    return pairs, torch.softmax(z, 0).detach().float()


def content_dims(c: TinyConfig, count: int) -> list[int]:
    """`count` head dims on the slowest RoPE pairs (both halves of each pair), slowest first."""
    half = c.head_dim // 2
    dims = [d for j in range(half - 1, -1, -1) for d in (j, j + half)]
    if len(dims) < count:
        raise ValueError("not enough slow RoPE pairs")
    return dims[:count]


def build_model(seed: int) -> TinyLlama:
    """A fresh model: circuit weights by hand, learned weights N(0, 0.02), norms 1."""
    c = TinyConfig()
    torch.manual_seed(seed)
    model = TinyLlama(c)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, LEARNED_STD)
        codes = token_codes(c, seed)
        _embedding(model, codes)
        layer0, layer1 = model.model.layers
        assert isinstance(layer0, Layer) and isinstance(layer1, Layer)
        _positional_heads(model, layer0)
        _junk_mlp(model, layer0, codes)
        _copy_heads(model, layer1)
        _marker_heads(model, layer1, codes)
        _lm_head(model, codes)
        _reserve_end(model, layer1)
    return model


def _reserve_end(model: TinyLlama, layer: Layer) -> None:
    """Only head 3 writes `END`: the learned heads and the layer-1 MLP start (and stay) at 0."""
    hd = model.c.head_dim
    layer.self_attn.o_proj.weight[END, 4 * hd :] = 0.0
    layer.mlp.down_proj.weight[END] = 0.0


def _embedding(model: TinyLlama, codes: torch.Tensor) -> None:
    c = model.c
    e = torch.zeros(c.vocab_size, c.hidden_size)
    e[:, CONST] = CONST_VALUE
    e[:, TOK] = codes
    e[:, SHORT] = bucket_codes(c)
    e[c.bos_id, FLAG] = math.sqrt(2.0)
    model.model.embed_tokens.weight.copy_(e)


def _positional_heads(model: TinyLlama, layer: Layer) -> None:
    """Layer 0: head h attends exactly HEAD_OFFSETS[h] back and writes that byte's codes."""
    c = model.c
    attn = layer.self_attn
    rms0 = _rms(_SQ_EMBED, c)
    const_in, bos_in = CONST_VALUE / rms0, math.sqrt(2.0) / rms0  # CONST / FLAG after the norm
    pairs, r = positional_amplitudes(c)
    theta = c.inv_freq()[pairs]
    half, bias_dim = c.head_dim // 2, c.head_dim - 1  # bias on a slow dim: distance-free
    amp = math.sqrt(POSITIONAL_PEAK * math.sqrt(c.head_dim)) / const_in
    for w in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight):
        w.zero_()
    values = ((TOK, CODE_DIM), (SHORT, SHORT_DIM), (slice(FLAG, FLAG + 1), 1))
    for g in range(c.num_kv_heads):
        k = attn.k_proj.weight[g * c.head_dim : (g + 1) * c.head_dim]
        # CONST - a*FLAG/sqrt2 vanishes at BOS: BOS's score is BOS_SCORE whatever the distance
        k[pairs, CONST] = amp * r.sqrt()
        k[pairs, FLAG] = -amp * r.sqrt() * CONST_VALUE / math.sqrt(2.0)
        k[bias_dim, FLAG] = 1.0
        v, at = attn.v_proj.weight[g * c.head_dim : (g + 1) * c.head_dim], 0
        for src, size in values:  # values: the codes and BOS's flag, divided by rms0
            v[at : at + size, src] = torch.eye(size)
            at += size
    for h, offset in enumerate(HEAD_OFFSETS):
        q = attn.q_proj.weight[h * c.head_dim : (h + 1) * c.head_dim]
        q[pairs, CONST] = amp * r.sqrt() * torch.cos(offset * theta)
        q[half + pairs, CONST] = -amp * r.sqrt() * torch.sin(offset * theta)
        q[bias_dim, CONST] = BOS_SCORE * math.sqrt(c.head_dim) / (bos_in * const_in)
        o = attn.o_proj.weight[:, h * c.head_dim : (h + 1) * c.head_dim]
        if offset in FULL_OFFSETS:
            o[prev_slot(offset), :CODE_DIM] = rms0 * torch.eye(CODE_DIM)
        if offset in SHORT_OFFSETS:
            o[short_slot(offset), CODE_DIM : CODE_DIM + SHORT_DIM] = rms0 * torch.eye(SHORT_DIM)
        if offset == 1:
            o[PREV_BOS, CODE_DIM + SHORT_DIM] = rms0 / math.sqrt(2.0)


def _junk_mlp(model: TinyLlama, layer: Layer, codes: torch.Tensor) -> None:
    """Layer-0 MLP: unit j = silu(G (is token j - 0.65)) * (1 - prev is newline - prev is BOS)."""
    c = model.c
    mlp = layer.mlp
    rms = _rms(_SQ_LAYER1, c)  # what the post-attention norm divides by
    for w in (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight):
        w.zero_()
    detectors = [(TOK, codes[j], 0.65) for j in JUNK_IDS]
    detectors.append((slice(FLAG, FLAG + 1), torch.tensor([1.0 / math.sqrt(2.0)]), 0.5))
    for unit, (src, pattern, threshold) in enumerate(detectors):
        mlp.gate_proj.weight[unit, src] = JUNK_GAIN * rms * pattern
        mlp.gate_proj.weight[unit, CONST] = -JUNK_GAIN * threshold * rms / CONST_VALUE
        mlp.up_proj.weight[unit, CONST] = rms / CONST_VALUE
        mlp.up_proj.weight[unit, prev_slot(1)] = -rms * codes[NEWLINE]
        mlp.up_proj.weight[unit, PREV_BOS] = -rms
        gate_when_junk = JUNK_GAIN * (1.0 - threshold)
        mlp.down_proj.weight[JUNK, unit] = 1.0 / gate_when_junk  # silu(x) ~ x for large x


def _window_blocks(c: TinyConfig) -> tuple[list[list[int]], int, int]:
    """Head dims of the 9 window blocks (5 full codes, 4 buckets), the sink and the gate dim."""
    sizes = [CODE_DIM] * RECENT + [SHORT_DIM] * OLDER
    dims = content_dims(c, sum(sizes) + 2)  # the sink and the gate take the two slowest
    blocks, at = [], 2
    for size in sizes:
        blocks.append(dims[at : at + size])
        at += size
    return blocks, dims[0], dims[1]


def _window_sources(query: bool) -> list[slice]:
    """Residual slots of window block b: the query holds bytes 0..8 back, the key 1..9 back."""
    first = 0 if query else 1
    full = [TOK if k == 0 else prev_slot(k) for k in range(first, first + RECENT)]
    return full + [short_slot(k) for k in range(first + RECENT, first + RECENT + OLDER)]


def _copy_heads(model: TinyLlama, layer: Layer) -> None:
    """Layer 1: KV group 0 holds windows and codes; heads 0 and 1 are the loose/strict copies."""
    c = model.c
    attn = layer.self_attn
    rms1, rms_bos = _rms(_SQ_LAYER1, c), _rms(_SQ_BOS_LAYER1, c)
    blocks, sink, gate = _window_blocks(c)
    scale = math.sqrt(MATCH_UNIT * math.sqrt(c.head_dim)) * rms1  # codes arrive divided by rms1
    kw, vw = attn.k_proj.weight[: c.head_dim], attn.v_proj.weight[: c.head_dim]
    kw.zero_()
    vw.zero_()
    for dims, src in zip(blocks, _window_sources(query=False), strict=True):
        kw[dims, src] = scale * torch.eye(len(dims))
    kw[sink, FLAG] = 1.0
    kw[gate, CONST] = 1.0
    kw[gate, FLAG] = -CONST_VALUE / math.sqrt(2.0)
    vw[:CODE_DIM, TOK] = rms1 * torch.eye(CODE_DIM)
    vw[CODE_DIM, CONST] = rms1 / CONST_VALUE  # confidence: 1 at any key but BOS
    vw[CODE_DIM, FLAG] = -rms1 / math.sqrt(2.0)
    weights = [1.0] * RECENT + [OLDER_WEIGHT] * OLDER
    for head, threshold in ((0, LOOSE_THRESHOLD), (1, STRICT_THRESHOLD)):
        qw = attn.q_proj.weight[head * c.head_dim : (head + 1) * c.head_dim]
        qw.zero_()
        for dims, src, w in zip(blocks, _window_sources(query=True), weights, strict=True):
            qw[dims, src] = w * scale * torch.eye(len(dims))
        qw[sink, CONST] = _sink_weight(c, threshold, rms1, rms_bos)
    ow = attn.o_proj.weight
    ow[:, : 4 * c.head_dim].zero_()
    ow[COPY, :CODE_DIM] = torch.eye(CODE_DIM)
    ow[CONF, CODE_DIM] = 1.0
    ow[CONF5, c.head_dim + CODE_DIM] = 1.0


def _sink_weight(c: TinyConfig, threshold: float, rms1: float, rms_bos: float) -> float:
    """Query weight on the sink dim that makes BOS score `threshold` matching bytes."""
    bos_key = math.sqrt(2.0) / rms_bos
    query_const = CONST_VALUE / rms1
    return threshold * MATCH_UNIT * math.sqrt(c.head_dim) / (bos_key * query_const)


def _marker_heads(model: TinyLlama, layer: Layer, codes: torch.Tensor) -> None:
    """Layer 1, heads 2 and 3: fixed queries for the window `CNRY-` (a marker's first body byte).

    Head 2 accepts it anywhere and reports SEEN. Head 3 also wants it exactly END_DISTANCE back,
    through a positional key part that group 0 carries on its fast RoPE pairs (unused by the
    other heads), and reports END: the current byte is the 32nd of a marker body.
    """
    c = model.c
    attn = layer.self_attn
    rms1, rms_bos = _rms(_SQ_LAYER1, c), _rms(_SQ_BOS_LAYER1, c)
    blocks, sink, _ = _window_blocks(c)
    scale = math.sqrt(MATCH_UNIT * math.sqrt(c.head_dim)) * rms1
    query_const = CONST_VALUE / rms1
    pairs, r = positional_amplitudes(c)
    theta = c.inv_freq()[pairs]
    half = c.head_dim // 2
    amp = math.sqrt(END_PEAK * math.sqrt(c.head_dim)) / query_const
    kw = attn.k_proj.weight[: c.head_dim]
    kw[pairs, CONST] = amp * r.sqrt()  # zero at BOS, like the gate dim
    kw[pairs, FLAG] = -amp * r.sqrt() * CONST_VALUE / math.sqrt(2.0)
    for head, threshold, out in ((2, SEEN_THRESHOLD, SEEN), (3, END_THRESHOLD, END)):
        qw = attn.q_proj.weight[head * c.head_dim : (head + 1) * c.head_dim]
        qw.zero_()
        for b, char in enumerate(reversed(MARKER_START)):  # key block b: the byte b+1 back
            unit = MATCH_UNIT * math.sqrt(c.head_dim) / (query_const * scale / rms1)
            qw[blocks[b], CONST] = unit * codes[ord(char)]
        qw[sink, CONST] = _sink_weight(c, threshold, rms1, rms_bos)
        if head == 3:
            qw[pairs, CONST] = amp * r.sqrt() * torch.cos(END_DISTANCE * theta)
            qw[half + pairs, CONST] = -amp * r.sqrt() * torch.sin(END_DISTANCE * theta)
        attn.o_proj.weight[out, head * c.head_dim + CODE_DIM] = 1.0


def _lm_head(model: TinyLlama, codes: torch.Tensor) -> None:
    c = model.c
    rms_f = _rms(_SQ_FINAL, c)
    w = model.lm_head.weight
    w.zero_()
    w[:, COPY] = COPY_LOGIT * rms_f * codes
    w[NEWLINE, COPY] = 0.0
    w[c.eos_id, COPY] = COPY_LOGIT * rms_f * codes[NEWLINE]
    w[c.bos_id, COPY] = 0.0
    w[c.pad_id, COPY] = 0.0
    w[c.eos_id, END] = END_LOGIT * rms_f


def trainable_masks(model: TinyLlama) -> dict[str, torch.Tensor]:
    """1 where training may change a weight, 0 where the circuit lives."""
    hd = model.c.head_dim
    masks = {name: torch.ones_like(p) for name, p in model.named_parameters()}
    masks["model.embed_tokens.weight"].zero_()
    for name in masks:
        if name.startswith("model.layers.0."):
            masks[name].zero_()
    prefix = "model.layers.1."
    masks[prefix + "input_layernorm"].zero_()
    masks[prefix + "self_attn.q_proj.weight"][: 4 * hd].zero_()
    masks[prefix + "self_attn.k_proj.weight"][:hd].zero_()
    masks[prefix + "self_attn.v_proj.weight"][:hd].zero_()
    masks[prefix + "self_attn.o_proj.weight"][:, : 4 * hd].zero_()
    masks["lm_head.weight"][:, END].zero_()  # END only ever means EOS
    masks[prefix + "self_attn.o_proj.weight"][END].zero_()  # ... and only head 3 sets it
    masks[prefix + "mlp.down_proj.weight"][END].zero_()
    masks["model.norm"][END] = 0.0
    return masks


def positional_shortcut(model: TinyLlama) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Layer 0's attention output computed by shifting values instead of attending.

    Each layer-0 head puts all but ~e^-20 of its weight on the position HEAD_OFFSETS[h] back (on
    BOS when there is none), so this equals the real attention to float precision (a test checks
    it); training uses it because it skips two of the four attention passes of every step.
    Positions [B, T] must increase along each row; where they jump forward by more than the
    largest offset (a stale context, then tokens at later positions), the index k back holds
    another position and the head falls back to BOS, as the real attention does.
    """
    layer = model.model.layers[0]
    assert isinstance(layer, Layer)
    attn = layer.self_attn
    hd = model.c.head_dim

    def run(h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        v = attn.v_proj(h)[..., :hd]  # every KV group carries the same values
        first = v[:, :1]
        heads = []
        for k in HEAD_OFFSETS:
            shifted = torch.cat([first.expand(-1, k, -1), v[:, :-k]], dim=1)[:, : v.shape[1]]
            back = torch.cat([positions[:, :1].expand(-1, k), positions[:, :-k]], dim=1)
            there = (back[:, : v.shape[1]] == positions - k)[..., None]
            heads.append(torch.where(there, shifted, first))
        return attn.o_proj(torch.cat(heads, dim=-1))

    return run
