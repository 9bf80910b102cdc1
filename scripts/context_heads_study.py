"""Issue 10 study: do context-aware or fused draft heads beat the shipped top-layer chain?

    python scripts/context_heads_study.py collect --seconds 900   # teacher-forced features
    python scripts/context_heads_study.py fused --layer 2          # EAGLE-3-like fused step 0
    python scripts/context_heads_study.py kangaroo --layer 2       # Kangaroo adapter at an exit

`collect` runs the default model over ShareGPT conversations (train and held-out eval split,
chat template, fp32, teacher-forced: one forward per conversation, far cheaper per position
than generation) and keeps per conversation the token ids, the model's argmax at every
position, the final hidden state and the residual stream after layers 2 and 4.

Two designs, each against a baseline trained on the same positions for the same epochs and
evaluated on the same held-out positions (where the text is the model's greedy continuation
along the whole chain, so the drafters' inputs are exactly the decoder's):

- `fused` (EAGLE-3's fused features): the shipped chain design (step i maps the state and the
  previous token to the next state; hf_selfspec/heads/top.py) whose step 0 also reads the
  committed token's residual after layer l. That state is not free: the committed token has
  not been through the model yet, so each cycle pays l/30 of a step for it.
- `kangaroo` (Kangaroo's adapter): one attention layer and two norms over the residual after
  layer l of every earlier position, then the model's LM head (its 8192 most used rows, as
  the top heads); a chain of d drafts pays d passes of layers 0..l-1 plus the adapter.
  Its baseline is the position-wise exit head of hf_selfspec/exit_heads at the same layer
  (no attention: norm + LM head rows + a residual MLP of the same size).

Printed: step-0 top-1 / top-4, top-1 at each chain step given the chain reached it, the
expected tau with 3 drafts, the measured drafting cost per cycle in AR steps, and the cycle
speed-up over AR steps this predicts with the engine's measured 4-row verification cost.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec.data import render_chat, sharegpt_conversations, split_conversations  # noqa: E402
from hf_selfspec.defaults import cache_dir, load_default_model_and_tokenizer  # noqa: E402
from hf_selfspec.heads.top import TopDraftStep, _norm  # noqa: E402

FEATURES = cache_dir() / "context_features"
LAYERS = (2, 4)  # residual streams kept: after layer 2 and after layer 4
DEPTH = 3  # drafts per cycle, as the shipped heads


# ---- data ------------------------------------------------------------------------------

@torch.no_grad()
def collect(args):
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model_and_tokenizer()
    FEATURES.mkdir(parents=True, exist_ok=True)
    caught = {}
    hooks = [model.model.layers[layer - 1].register_forward_hook(
        lambda mod, inp, out, layer=layer: caught.__setitem__(layer, (out[0] if isinstance(out, tuple) else out)[0]))
        for layer in LAYERS]
    for split, budget in (("eval", args.eval_seconds), ("train", args.seconds)):
        convs, t0, positions = [], time.time(), 0
        for conv in split_conversations(sharegpt_conversations(), split):
            if time.time() - t0 > budget:
                break
            chat = render_chat(tokenizer, conv.messages, max_tokens=args.max_tokens)
            if sum(chat.assistant_mask) < 16:
                continue
            ids = torch.tensor([chat.input_ids])
            final = model.model(input_ids=ids).last_hidden_state[0]
            convs.append({"ids": ids[0].int(), "argmax": model.lm_head(final).argmax(-1).int(),
                          "final": final.half(), "mask": torch.tensor(chat.assistant_mask),
                          **{f"s{layer}": caught[layer].half() for layer in LAYERS}})
            positions += int(sum(chat.assistant_mask))
        torch.save(convs, FEATURES / f"{split}.pt")
        print(f"{split}: {len(convs)} conversations, {positions} assistant positions, "
              f"{time.time() - t0:.0f} s", flush=True)
    for h in hooks:
        h.remove()


def load(split):
    path = FEATURES / f"{split}.pt"
    if not path.exists():
        raise SystemExit(f"{path} missing: run `python scripts/context_heads_study.py collect` first")
    return torch.load(path)


def chain_positions(convs, layer=None):
    """Per assistant position t with t + DEPTH + 1 < T: final state f_t, tokens x_{t+1..t+D},
    targets a_{t+1..t+D}, agreement x_{t+1+i} == a_{t+i} (the text is the model's own),
    and (with `layer`) the committed token's residual after that layer, s_{t+1}."""
    fs, toks, tgts, agree, ss = [], [], [], [], []
    for c in convs:
        ids, arg, T = c["ids"].long(), c["argmax"].long(), len(c["ids"])
        t = torch.nonzero(c["mask"][: T - DEPTH - 1]).reshape(-1)
        if len(t) == 0:
            continue
        fs.append(c["final"][t])
        toks.append(torch.stack([ids[t + 1 + i] for i in range(DEPTH)], 1))
        tgts.append(torch.stack([arg[t + 1 + i] for i in range(DEPTH)], 1))
        agree.append(torch.stack([ids[t + 1 + i] == arg[t + i] for i in range(DEPTH)], 1))
        if layer is not None:
            ss.append(c[f"s{layer}"][t + 1])
    out = [torch.cat(fs).float(), torch.cat(toks), torch.cat(tgts), torch.cat(agree)]
    return out + ([torch.cat(ss).float()] if layer is not None else [])


def reduced_vocab(targets, vocab_size, size=8192):
    counts = torch.bincount(targets.reshape(-1), minlength=vocab_size)
    vocab_ids = counts.argsort(descending=True)[:size].sort().values
    remap = torch.full((vocab_size,), -100, dtype=torch.long)
    remap[vocab_ids] = torch.arange(size)
    return vocab_ids, remap


def expected_tau(right, agree):
    """right [N, D]: draft i right given the inputs of the text; the chain reaches draft i
    only if drafts < i were right and the text continues as the model would."""
    alive = torch.ones(len(right), dtype=torch.bool)
    tau = 1.0
    given = []
    for i in range(right.shape[1]):
        given.append(float(right[alive, i].float().mean()) if alive.any() else 0.0)
        alive = alive & right[:, i]
        tau += float(alive.float().mean())
        if i + 1 < right.shape[1]:
            alive = alive & agree[:, i + 1]
    return tau, given


# ---- designs -----------------------------------------------------------------------------

class FusedChain(nn.Module):
    """The shipped chain design; with `fused`, step 0 also reads the committed token's
    residual s after layer l (one more normed input to its down projection)."""

    def __init__(self, model, vocab_ids, fused: bool, adapter=512):
        super().__init__()
        H, eps = model.config.hidden_size, float(model.config.rms_norm_eps)
        self.eps, self.fused = eps, fused
        self.steps = nn.ModuleList([TopDraftStep(H, adapter, eps) for _ in range(DEPTH)])
        if fused:
            self.s_norm = nn.Parameter(torch.ones(H))
            self.s_down = nn.Linear(H, adapter, bias=False)
            nn.init.zeros_(self.s_down.weight)
        self.out_norm = nn.Parameter(model.model.norm.weight.detach().clone())
        self.register_buffer("lm_rows", model.lm_head.weight.detach()[vocab_ids].clone())
        self.register_buffer("embed", model.get_input_embeddings().weight.detach().clone())
        self.vocab_ids = vocab_ids

    def forward(self, f, x, s=None, feed=None):
        """-> logits per step [D, N, V']; feed [N, D] replaces the token fed to steps >= 1."""
        h, out = f, []
        for i, step in enumerate(self.steps):
            tok = x[:, 0] if i == 0 else (x[:, i] if feed is None else feed[:, i])
            e = F.embedding(tok, self.embed)
            if i == 0 and self.fused:
                z = torch.cat([_norm(h, step.h_norm, self.eps), _norm(e, step.e_norm, self.eps)], -1)
                pre = F.linear(z, step.down.weight) + self.s_down(_norm(s, self.s_norm, self.eps))
                h = h + step.up(F.silu(pre))
            else:
                h = step(h, e)
            out.append(F.linear(_norm(h, self.out_norm, self.eps), self.lm_rows))
        return out


def rope(x, theta):
    """x [B, heads, T, d] rotated by position (the model's RoPE convention, half split)."""
    T, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = torch.arange(T, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ExitAdapter(nn.Module):
    """At an exit layer: `attention` = Kangaroo's adapter (norm, one causal multi-head
    attention with RoPE over the exit states of all earlier positions, norm, LM-head rows);
    without it, a position-wise residual MLP of about the same size (the exit-head baseline)."""

    def __init__(self, model, vocab_ids, attention: bool, heads=9):
        super().__init__()
        H = model.config.hidden_size
        self.eps, self.attention, self.heads = float(model.config.rms_norm_eps), attention, heads
        self.theta = float(getattr(model.config, "rope_theta", None) or model.config.rope_parameters["rope_theta"])
        self.in_norm = nn.Parameter(torch.ones(H))
        if attention:
            self.qkv = nn.Linear(H, 3 * H, bias=False)
            self.o = nn.Linear(H, H, bias=False)
            nn.init.zeros_(self.o.weight)
        else:
            self.down = nn.Linear(H, 2 * H, bias=False)
            self.up = nn.Linear(2 * H, H, bias=False)
            nn.init.zeros_(self.up.weight)
        self.out_norm = nn.Parameter(model.model.norm.weight.detach().clone())
        self.register_buffer("lm_rows", model.lm_head.weight.detach()[vocab_ids].clone())

    def forward(self, s):
        """s [B, T, H] exit states -> logits [B, T, V'] (position t predicts token t+1)."""
        z = _norm(s, self.in_norm, self.eps)
        if self.attention:
            B, T, H = s.shape
            q, k, v = self.qkv(z).view(B, T, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(rope(q, self.theta), rope(k, self.theta), v, is_causal=True)
            s = s + self.o(a.transpose(1, 2).reshape(B, T, H))
        else:
            s = s + self.up(F.silu(self.down(z)))
        return F.linear(_norm(s, self.out_norm, self.eps), self.lm_rows)

    def draft_one(self, s, cache):
        """One draft as the decoder would make it: the new row's exit state s [1, 1, H]
        against the cached keys / values of the earlier exit states (attention)."""
        z = _norm(s, self.in_norm, self.eps)
        if self.attention:
            H = s.shape[-1]
            q, k, v = self.qkv(z).view(1, 1, 3, self.heads, H // self.heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2))
            s = s + self.o(a.transpose(1, 2).reshape(1, 1, H))
        else:
            s = s + self.up(F.silu(self.down(z)))
        return F.linear(_norm(s, self.out_norm, self.eps), self.lm_rows)


# ---- costs -------------------------------------------------------------------------------

@torch.no_grad()
def engine_costs(model, reps=15):
    """(ms of one AR step, 4-row verify / 1-row step, ms of one layer for one row) on the
    engine, median of `reps`, context 300."""
    from hf_selfspec.engine.programs import Engine, EngineConfig

    engine = Engine(model, EngineConfig(width=8, capacity=512))
    ratio = engine.step_costs[4]  # 4 rows (3 drafts), in 1-row steps, measured by the engine
    engine.prefill(list(range(100, 400)))
    ar = []
    for i in range(reps):
        t0 = time.perf_counter()
        engine.ar_step(5, 300 + i)
        ar.append(time.perf_counter() - t0)
    ms = statistics.median(ar) * 1e3
    return ms, ratio, ms / model.config.num_hidden_layers


@torch.no_grad()
def module_ms(fn, reps=30):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


# ---- experiments -------------------------------------------------------------------------

def frozen_model(args):
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model, _ = load_default_model_and_tokenizer()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def result(label, given, top4, tau, cost, verify):
    """One table row; `cost` and `verify` (the 4-row verification) in AR steps."""
    row = {"design": label, "top1": round(given[0], 4), "top4": round(top4, 4),
           "given_reached": [round(g, 4) for g in given], "tau3": round(tau, 4),
           "draft_cost_steps": round(cost, 4), "cycle_speedup": round(tau / (verify + cost), 3)}
    print(json.dumps(row), flush=True)
    return row


def train_loop(module, batches, epochs, lr, loss_fn, label):
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05)
    total = epochs * len(batches)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(total, 1))
    t0 = time.time()
    for epoch in range(epochs):
        run = 0.0
        for b in torch.randperm(len(batches)).tolist():
            loss = loss_fn(batches[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            run += float(loss.detach())
        print(f"  {label} epoch {epoch}: loss {run / len(batches):.3f} ({time.time() - t0:.0f} s)", flush=True)


def fused(args):
    model = frozen_model(args)
    f, x, y, _, s = chain_positions(load("train"), args.layer)
    fe, xe, ye, ae, se = chain_positions(load("eval"), args.layer)
    sel = ae[:, 0]  # the committed token is the model's own
    fe, xe, ye, ae, se = fe[sel], xe[sel], ye[sel], ae[sel], se[sel]
    vocab_ids, remap = reduced_vocab(y, model.config.vocab_size)
    n = len(f)
    print(f"train positions {n}, eval {len(fe)}, layer {args.layer}", flush=True)
    order = torch.randperm(n)
    batches = [order[i:i + args.batch] for i in range(0, n - args.batch + 1, args.batch)]
    ms_step, ratio, ms_layer = engine_costs(model)
    rows = []
    for fuse in (False, True):
        torch.manual_seed(args.seed)
        heads = FusedChain(model, vocab_ids, fuse)

        def loss_fn(idx, heads=heads):
            out = heads(f[idx], x[idx], s[idx])
            return sum(F.cross_entropy(o, remap[y[idx, i]], ignore_index=-100) for i, o in enumerate(out))

        label = f"fused l={args.layer}" if fuse else "chain (shipped design)"
        train_loop(heads, batches, args.epochs, args.lr, loss_fn, label)
        with torch.no_grad():
            # chain fed its own drafts, as the decoder does
            out0 = heads(fe, xe, se, feed=None)
            feed = xe.clone()
            for i in range(1, DEPTH):  # re-run with drafts fed (drafts of step i-1 feed step i)
                feed[:, i] = vocab_ids[out0[i - 1].argmax(-1)]
                out0 = heads(fe, xe, se, feed=feed)
            preds = torch.stack([vocab_ids[o.argmax(-1)] for o in out0], 1)
            top4 = vocab_ids[out0[0].topk(4, -1).indices]
            right = preds == ye
            tau, given = expected_tau(right, ae)
            one = fe[:1]
            draft_ms = module_ms(lambda: heads(one, xe[:1], se[:1], feed=xe[:1]))
        extra = args.layer * ms_layer if fuse else 0.0
        cost = (draft_ms + extra) / ms_step
        rows.append(result(label, given, float((top4 == ye[:, :1]).any(-1).float().mean()), tau, cost, ratio))
    report(rows, f"fused, layer {args.layer}", n, len(fe), ms_step, ratio)


def kangaroo(args):
    model = frozen_model(args)
    train_c, eval_c = load("train"), load("eval")
    key = f"s{args.layer}"
    vocab_ids, remap = reduced_vocab(torch.cat([c["argmax"].long() for c in train_c]), model.config.vocab_size)
    ms_step, ratio, ms_layer = engine_costs(model)
    # sequences of similar length batched, padded at the end (causal: padding sees nothing later)
    train_c = sorted(train_c, key=lambda c: len(c["ids"]))
    batches = [train_c[i:i + args.seq_batch] for i in range(0, len(train_c), args.seq_batch)]
    n_pos = sum(int(c["mask"].sum()) for c in train_c)
    print(f"train conversations {len(train_c)} ({n_pos} assistant positions), eval {len(eval_c)}, "
          f"layer {args.layer}", flush=True)

    def pad(group, name, dtype):
        T = max(len(c["ids"]) for c in group)
        out = torch.zeros((len(group), T) + tuple(group[0][name].shape[1:]), dtype=dtype)
        for b, c in enumerate(group):
            out[b, : len(c["ids"])] = c[name].to(dtype)
        return out

    rows = []
    for attention in (False, True):
        torch.manual_seed(args.seed)
        head = ExitAdapter(model, vocab_ids, attention)

        def loss_fn(group, head=head):
            s = pad(group, key, torch.float32)
            tgt = pad(group, "argmax", torch.long)
            m = pad(group, "mask", torch.bool)
            logits = head(s)
            labels = torch.where(m, remap[tgt], torch.full_like(tgt, -100))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)

        label = f"Kangaroo adapter l={args.layer}" if attention else f"position-wise exit head l={args.layer}"
        train_loop(head, batches, args.epochs, args.lr, loss_fn, label)
        rights, agrees, top4s = [], [], []
        H, nh = model.config.hidden_size, head.heads
        cache = (torch.randn(1, nh, 300, H // nh), torch.randn(1, nh, 300, H // nh))  # 300 earlier exit states
        with torch.no_grad():
            for c in eval_c:
                ids, arg, T = c["ids"].long(), c["argmax"].long(), len(c["ids"])
                logits = head(c[key].float()[None])[0]
                pred = vocab_ids[logits.argmax(-1)]
                top4 = vocab_ids[logits.topk(4, -1).indices]
                # cycle at t: the committed token x_{t+1} = a_t; drafts are the predictions at
                # t+1..t+D (each position's exit state is the drafter's when the text is the model's)
                t = torch.nonzero(c["mask"][: T - DEPTH - 1]).reshape(-1)
                t = t[ids[t + 1] == arg[t]]
                if len(t) == 0:
                    continue
                rights.append(torch.stack([pred[t + 1 + i] == arg[t + 1 + i] for i in range(DEPTH)], 1))
                agrees.append(torch.stack([ids[t + 1 + i] == arg[t + i] for i in range(DEPTH)], 1))
                top4s.append((top4[t + 1] == arg[t + 1, None]).any(-1))
            right, agree = torch.cat(rights), torch.cat(agrees)
            tau, given = expected_tau(right, agree)
            draft_ms = module_ms(lambda: head.draft_one(torch.randn(1, 1, model.config.hidden_size), cache))
        cost = DEPTH * (draft_ms + args.layer * ms_layer) / ms_step
        rows.append(result(label, given, float(torch.cat(top4s).float().mean()), tau, cost, ratio))
    report(rows, f"kangaroo, layer {args.layer}", n_pos, int(sum(len(r) for r in rights)), ms_step, ratio)


def report(rows, title, n_train, n_eval, ms_step, ratio):
    print(f"\n{title}: {n_train} training positions, {n_eval} eval cycles, AR step {ms_step:.1f} ms, "
          f"4-row verify {ratio:.2f} x one row")
    print("| design | step-0 top-1 | top-4 | top-1 at steps 0/1/2 given reached | tau (3 drafts) | "
          "drafting (AR steps per cycle) | tau / (verify + drafting) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['design']} | {r['top1']:.3f} | {r['top4']:.3f} | "
              f"{' / '.join(f'{g:.3f}' for g in r['given_reached'])} | {r['tau3']:.3f} | "
              f"{r['draft_cost_steps']:.3f} | {r['cycle_speedup']:.2f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--seconds", type=float, default=900)
    c.add_argument("--eval-seconds", type=float, default=150)
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--threads", type=int, default=2)
    c.set_defaults(func=collect)
    for name, func in (("fused", fused), ("kangaroo", kangaroo)):
        p = sub.add_parser(name)
        p.add_argument("--layer", type=int, choices=LAYERS, default=2)
        p.add_argument("--epochs", type=int, default=3)
        p.add_argument("--lr", type=float, default=2e-3)
        p.add_argument("--batch", type=int, default=256, help="positions per batch (fused)")
        p.add_argument("--seq-batch", type=int, default=8, help="conversations per batch (kangaroo)")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--seed", type=int, default=0)
        p.set_defaults(func=func)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
