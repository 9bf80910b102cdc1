"""Head-design study and trainer for top-layer draft heads (hf_selfspec/heads/top.py).

    python scripts/head_study.py collect --seconds 600          # teacher-forced ShareGPT features
    python scripts/head_study.py train --out hf_selfspec/default_heads_top   # train, evaluate, save

`collect` runs the default model over held-out-split ShareGPT conversations (chat
template, fp32) and stores, per conversation, the token ids, the model's own argmax at every
position and the final hidden state (after the final norm). `train` fits a chain of top
draft steps (step i predicts the model's argmax i+1 tokens after the committed token) and
reports on the EVAL conversations, at positions where the text is the model's own greedy
continuation (so the inputs are exactly what the decoder sees): per-step top-1 / top-4
agreement, the chain acceptance and the expected tau with two drafts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hf_selfspec.data import render_chat, sharegpt_conversations, split_conversations  # noqa: E402
from hf_selfspec.defaults import cache_dir, load_default_model_and_tokenizer  # noqa: E402
from hf_selfspec.heads.top import TopDraftHeads, TopHeadsConfig  # noqa: E402

FEATURES = cache_dir() / "top_features"


@torch.no_grad()
def collect(args):
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model_and_tokenizer()
    FEATURES.mkdir(parents=True, exist_ok=True)
    splits = (("eval", args.eval_seconds), ("train", args.seconds))
    if args.part > 0:  # more training data: skip the conversations earlier parts used
        splits = (("train", args.seconds),)
    for split, budget in splits:
        ids_l, arg_l, fin_l, mask_l = [], [], [], []
        t0, positions = time.time(), 0
        done = json.loads((FEATURES / "parts.json").read_text()) if (FEATURES / "parts.json").exists() else {}
        skip = sum(done.get(str(p), 0) for p in range(args.part)) if split == "train" else 0
        for index, conv in enumerate(split_conversations(sharegpt_conversations(), split)):
            if index < skip:
                continue
            if time.time() - t0 > budget:
                break
            chat = render_chat(tokenizer, conv.messages, max_tokens=args.max_tokens)
            if sum(chat.assistant_mask) < 16:
                continue
            ids = torch.tensor([chat.input_ids])
            out = model.model(input_ids=ids)
            final = out.last_hidden_state[0]
            argmax = model.lm_head(final).argmax(-1)
            ids_l.append(ids[0].int())
            arg_l.append(argmax.int())
            fin_l.append(final.half())
            mask_l.append(torch.tensor(chat.assistant_mask))
            positions += int(sum(chat.assistant_mask))
        name = split if split == "eval" or args.part == 0 else f"train{args.part}"
        torch.save({"ids": ids_l, "argmax": arg_l, "final": fin_l, "mask": mask_l},
                   FEATURES / f"{name}.pt")
        if split == "train":
            done[str(args.part)] = index - skip
            (FEATURES / "parts.json").write_text(json.dumps(done))
        print(f"{split}: {len(ids_l)} conversations, {positions} assistant positions, "
              f"{time.time() - t0:.0f} s", flush=True)


# training prompts per collect-own part: part N uses prompts [N*stride, (N+1)*stride) in
# order, as far as its time budget goes (a part of 30 min uses ~600 at batch 32)
OWN_PART_STRIDE = 2000


@torch.no_grad()
def collect_own(args):
    """The model's own greedy replies to the first user turn of ShareGPT conversations
    (batched HF generate, left padding, static cache); the final hidden state (after the
    final norm) of every decoding step is caught by a hook on the norm, so each reply
    position costs one batched decoding step and no second forward. Stored per reply:
    ids = [last prompt token] + reply[:-1], argmax = the model's token after each row
    (= the reply), final = the rows' final hidden states: exactly the (f_t, x_{t+1}, a_{t+1})
    the decoder sees, with no teacher forcing. Part N > 0 adds training data
    (own_train{N}.pt) from the prompts after OWN_PART_STRIDE * N, disjoint from other parts."""
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model_and_tokenizer()
    FEATURES.mkdir(parents=True, exist_ok=True)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    caught = []
    hook = model.model.norm.register_forward_hook(lambda mod, inp, out: caught.append(out[:, -1].clone()))
    splits = (("eval", args.eval_seconds), ("train", args.seconds)) if args.part == 0 else (("train", args.seconds),)
    for split, budget in splits:
        if budget <= 0:
            continue
        prompts = []
        for conv in split_conversations(sharegpt_conversations(), split):
            first = next(m["content"] for m in conv.messages if m["role"] == "user")
            ids = tokenizer.apply_chat_template([{"role": "user", "content": first}],
                                                tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
            if 8 <= len(ids) <= args.max_prompt:
                prompts.append(ids)
        if split == "train":
            lo, hi = OWN_PART_STRIDE * args.part, OWN_PART_STRIDE * (args.part + 1)
            if lo >= len(prompts):
                raise SystemExit(f"--part {args.part}: only {len(prompts)} training prompts")
            prompts = prompts[lo:hi]
        ids_l, arg_l, fin_l, mask_l = [], [], [], []
        t0, positions, used = time.time(), 0, 0
        for start in range(0, len(prompts), args.batch):
            if time.time() - t0 > budget:
                break
            batch = sorted(prompts[start:start + args.batch], key=len)
            used += len(batch)
            width = max(len(p) for p in batch)
            inp = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            caught.clear()
            out = model.generate(inp, attention_mask=att, max_new_tokens=args.max_new,
                                 do_sample=False, pad_token_id=pad, eos_token_id=eos,
                                 cache_implementation="static")
            finals = torch.stack(caught, 1)  # [B, steps, H]
            for b, (row, p) in enumerate(zip(out[:, width:].tolist(), batch)):
                reply = []
                for tok in row:
                    reply.append(tok)
                    if tok == eos:
                        break
                if len(reply) < 8:
                    continue
                R = len(reply)
                ids_l.append(torch.tensor([p[-1]] + reply[:-1], dtype=torch.int32))
                arg_l.append(torch.tensor(reply, dtype=torch.int32))
                fin_l.append(finals[b, :R].half())
                mask = torch.ones(R, dtype=torch.bool)
                mask[-1] = False
                mask_l.append(mask)
                positions += R - 1
            print(f"  {split}: {used} prompts, {positions} positions, {time.time() - t0:.0f} s",
                  flush=True)
        name = f"own_{split}" if split == "eval" or args.part == 0 else f"own_train{args.part}"
        torch.save({"ids": ids_l, "argmax": arg_l, "final": fin_l, "mask": mask_l},
                   FEATURES / f"{name}.pt")
        print(f"{split}: {len(ids_l)} replies, {positions} positions, {time.time() - t0:.0f} s", flush=True)
    hook.remove()


def examples(data, depth, future=False):
    """Per position t in an assistant span: f_t, tokens tok_0..tok_{D-1} = x_{t+1..t+D},
    targets a_{t+1..t+D}; and whether the text from t on is the model's greedy continuation
    (x_{t+1+i} == a_{t+i}) for each step. With `future`, also the final states
    f_{t+1..t+D} [N, D, H] (float16) whose argmaxes the targets are: the model's whole
    next-token distributions, for soft targets."""
    fs, toks, tgts, agree, futures = [], [], [], [], []
    for ids, arg, fin, mask in zip(data["ids"], data["argmax"], data["final"], data["mask"]):
        T = len(ids)
        t = torch.nonzero(mask[: T - depth]).reshape(-1)
        if len(t) == 0:
            continue
        fs.append(fin[t])
        toks.append(torch.stack([ids[t + 1 + i] for i in range(depth)], 1))
        tgts.append(torch.stack([arg[t + 1 + i] for i in range(depth)], 1))
        agree.append(torch.stack([ids[t + 1 + i] == arg[t + i] for i in range(depth)], 1))
        if future:
            futures.append(torch.stack([fin[t + 1 + i] for i in range(depth)], 1).half())
    out = (torch.cat(fs).float(), torch.cat(toks).long(), torch.cat(tgts).long(), torch.cat(agree))
    return out + (torch.cat(futures),) if future else out


def train(args):
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model, _ = load_default_model_and_tokenizer()
    from hf_selfspec.heads.repo import fingerprint

    files = []
    if args.data in ("tf", "both"):  # teacher-forced parts from `collect` (--part N adds more)
        files += [FEATURES / "train.pt"] + sorted(FEATURES.glob("train[0-9]*.pt"))
    if args.data in ("own", "both"):  # the model's own replies from `collect-own`
        files += [FEATURES / "own_train.pt"] + sorted(FEATURES.glob("own_train[0-9]*.pt"))
    if args.parts:  # only these parts (0 = the first, train.pt / own_train.pt)
        wanted = {int(p) for p in args.parts.split(",")}
        files = [f for f in files if int(f.stem.split("train")[1] or 0) in wanted]
    missing = [str(f) for f in files if not f.exists()]
    if missing or not files:
        raise SystemExit(f"training features missing: {missing or args.data}; run collect / collect-own first")
    tr = None
    for path in files:
        more = torch.load(path)
        tr = more if tr is None else {key: tr[key] + more[key] for key in tr}
    D = args.depth
    soft = args.loss == "soft"
    f_tr, x_tr, y_tr, _, *future = examples(tr, D, future=soft)
    fut_tr = future[0] if future else None
    del tr
    if args.max_positions and len(f_tr) > args.max_positions:  # equal-size comparisons
        keep = torch.randperm(len(f_tr), generator=torch.Generator().manual_seed(args.seed))[: args.max_positions]
        f_tr, x_tr, y_tr = f_tr[keep], x_tr[keep], y_tr[keep]
        fut_tr = fut_tr[keep] if future else None
    eval_sets = {}
    for name, file in (("tf_eval", "eval.pt"), ("own_eval", "own_eval.pt")):
        if (FEATURES / file).exists():
            eval_sets[name] = examples(torch.load(FEATURES / file), D)
    if args.variant == "medusa":  # no token input: step i sees only the final state (Medusa)
        x_tr = torch.zeros_like(x_tr)
        eval_sets = {k: (f, torch.zeros_like(x), y, a) for k, (f, x, y, a) in eval_sets.items()}
    counts = torch.bincount(y_tr.reshape(-1), minlength=model.config.vocab_size)
    vocab_ids = counts.argsort(descending=True)[: args.vocab].sort().values
    if args.init:  # fine-tune existing heads: their vocabulary and shape
        from hf_selfspec.heads.top_repo import load_top_heads

        init = load_top_heads(args.init, model)
        init_training = dict(init.config.training or {})
        vocab_ids = init.vocab_ids.clone()
    covered = float(counts[vocab_ids].sum() / counts.sum())
    remap = torch.full((model.config.vocab_size,), -100, dtype=torch.long)
    remap[vocab_ids] = torch.arange(len(vocab_ids))
    cfg = TopHeadsConfig(
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct", base_fingerprint=fingerprint(model),
        num_layers=model.config.num_hidden_layers, hidden_size=model.config.hidden_size,
        vocab_size=model.config.vocab_size, depth=D, adapter_dim=args.adapter,
        reduced_vocab=len(vocab_ids), rms_norm_eps=float(model.config.rms_norm_eps))
    heads = TopDraftHeads(cfg, vocab_ids).init_from_model(model)
    if args.init:
        heads = init.deepened(D) if D > init.config.depth else init
        if D < heads.config.depth:
            raise SystemExit(f"--depth {D} is below the depth of the --init heads ({heads.config.depth})")
        heads.calibration = None  # thresholds are re-fitted for the new weights (0: always draft)
    if args.new_steps_only:  # deepened heads: keep the steps (and out norm) they had, train the new ones
        if not args.init:
            raise SystemExit("--new-steps-only needs --init")
        for i, step in enumerate(heads.steps):
            step.requires_grad_(i >= init.config.depth)
        heads.out_norm.requires_grad_(False)
    params = [p for n, p in heads.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay)
    n = len(f_tr)
    steps_total = args.epochs * (n // args.batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=max(steps_total, 1))
    print(f"train positions {n} ({args.data}), eval {[len(v[0]) for v in eval_sets.values()]}, "
          f"V={len(vocab_ids)} covering {covered:.1%} of targets", flush=True)
    t0 = time.time()
    for epoch in range(args.epochs):
        perm = torch.randperm(n)
        total = 0.0
        for b in range(n // args.batch):
            idx = perm[b * args.batch:(b + 1) * args.batch]
            h = f_tr[idx]
            loss = 0.0
            if soft:  # the model's distribution over the heads' vocabulary at each step
                with torch.no_grad():
                    teacher = torch.softmax(fut_tr[idx].float() @ heads.lm_rows.T, -1)  # [b, D, V]
            for i in range(D):
                h, logits = heads.step_logits(i, h, x_tr[idx, i])
                if soft:
                    loss = loss - (teacher[:, i] * F.log_softmax(logits.float(), -1)).sum(-1).mean()
                else:
                    loss = loss + F.cross_entropy(logits.float(), remap[y_tr[idx, i]], ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach())
        print(f"epoch {epoch}: loss {total / max(n // args.batch, 1):.3f}  ({time.time() - t0:.0f} s)",
              flush=True)
    report = {}
    for name, (f_ev, x_ev, y_ev, agree_ev) in eval_sets.items():
        # tf_eval stays unprefixed: the keys earlier model cards and docs quote
        prefix = "" if name == "tf_eval" else f"{name}_"
        for key, value in evaluate(heads, f_ev, x_ev, y_ev, agree_ev, feed_drafts=args.variant == "chain").items():
            report[prefix + key] = value
    report.update(draft_cost_in_steps=draft_cost(model, heads), variant=args.variant, data=args.data)
    report.update(loss=args.loss, train_positions=n, new_steps_only=bool(args.new_steps_only), vocab_coverage=round(covered, 4),
                  train_seconds=round(time.time() - t0, 1), epochs=args.epochs, adapter=args.adapter)
    if args.init:  # provenance for the model card: what was fine-tuned
        report["init_training"] = init_training
    if args.reproduce:
        report["reproduce"] = args.reproduce
    print(json.dumps(report, indent=1))
    if args.out:
        from hf_selfspec.heads.top_repo import save_top_heads

        heads.config.training = report
        save_top_heads(heads, args.out)
        print(f"saved {args.out}")


@torch.no_grad()
def draft_cost(model, heads, reps=20):
    """ms of a full chain (every step drafts) / ms of an engine AR step (1 row), both
    median of `reps`."""
    import statistics

    from hf_selfspec.engine.programs import Engine, EngineConfig

    engine = Engine(model, EngineConfig(width=8, capacity=512))
    engine.prefill(list(range(100, 300)))
    f = torch.randn(model.config.hidden_size)
    ar, dr = [], []
    for i in range(reps):
        t0 = time.perf_counter()
        engine.ar_step(5, 200 + i)
        ar.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        heads.draft(f, 5, heads.config.depth, [0.0] * heads.config.depth)
        dr.append(time.perf_counter() - t0)
    return round(statistics.median(dr) / statistics.median(ar), 4)


@torch.no_grad()
def evaluate(heads, f, x, y, agree, feed_drafts=True):
    """Agreement on eval positions where the text is the model's own greedy continuation,
    with the chain fed its own drafts (exactly the decoder's inputs)."""
    D = heads.config.depth
    sel = agree[:, 0]  # x_{t+1} == a_t: the committed token is the model's own
    f, x, y, agree = f[sel], x[sel], y[sel], agree[sel]
    h = f
    prev = x[:, 0]
    alive = torch.ones(len(f), dtype=torch.bool)
    report = {"positions": int(len(f))}
    taus = {}
    for i in range(D):
        h, logits = heads.step_logits(i, h, prev)
        probs = torch.softmax(logits.float(), -1)
        conf, idx = probs.max(-1)
        draft = heads.vocab_ids[idx]
        top4 = heads.vocab_ids[probs.topk(4, -1).indices]
        right = draft == y[:, i]
        # a later step is only reached when the previous draft was right; then the text
        # continues as the model would iff the next dataset token agrees too
        report[f"step{i}_top1_given_reached"] = round(float(right[alive].float().mean()), 4)
        report[f"step{i}_top4_given_reached"] = round(float((top4 == y[:, i:i + 1]).any(-1)[alive].float().mean()), 4)
        for thr in (0.0, 0.2, 0.4, 0.6):
            key = f"accept_thr{thr}"
            ok = right & (conf >= thr)
            prev_alive = taus.get(key, torch.ones(len(f), dtype=torch.bool))
            taus[key] = prev_alive & ok
            report.setdefault(f"tau_thr{thr}", 1.0)
            report[f"tau_thr{thr}"] += float(taus[key].float().mean())
        alive = alive & right
        if i + 1 < D:
            alive = alive & agree[:, i + 1]
            prev = draft if feed_drafts else x[:, i + 1]
    for k in list(report):
        if k.startswith("tau"):
            report[k] = round(report[k], 4)
    return report


def trees(args):
    """Chain vs siblings at the same verification width, on the own-generation eval set (the
    decoder's inputs): accepted tokens per cycle (tau) of each way to spend the drafts.

    3 rows (2 drafts; the free width of the micro / wx layouts): the chain (step 0, step 1),
    step 0's top-2 siblings, the oracle (the better of the two per position: the ceiling of
    any rule), and the rule "siblings when p2 > scale * p1 * q1" (p1, p2: step 0's top-2
    probabilities, q1: step 1's top probability), which needs nothing the decoder lacks.
    4 rows (3 drafts; the free width of the wx4 layout; heads of depth >= 3): the chain
    (steps 0, 1, 2), the chain of two plus step 0's runner-up as a sibling leaf, step 0's
    top-3 siblings, and the oracle over the three."""
    torch.set_num_threads(args.threads)
    model, _ = load_default_model_and_tokenizer()
    from hf_selfspec.heads.top_repo import load_top_heads

    heads = load_top_heads(args.heads, model)
    depth = 3 if args.rows == 4 else 2
    if heads.config.depth < depth:
        raise SystemExit(f"--rows {args.rows} needs heads of depth >= {depth}, these have {heads.config.depth}")
    f, x, y, agree = examples(torch.load(FEATURES / "own_eval.pt"), depth)
    sel = agree.all(1)  # the text is the model's own continuation over the whole chain
    f, x, y = f[sel].to(heads.out_norm.dtype), x[sel], y[sel]
    with torch.no_grad():
        h, logits = heads.step_logits(0, f, x[:, 0])
        probs = torch.softmax(logits.float(), -1)
        p, idx = probs.topk(3, -1)
        d1, d1b, d1c = (heads.vocab_ids[idx[:, i]] for i in range(3))
        h1, logits1 = heads.step_logits(1, h, d1)
        probs1 = torch.softmax(logits1.float(), -1)
        q1, idx1 = probs1.max(-1)
        d2 = heads.vocab_ids[idx1]
        if depth == 3:
            _, logits2 = heads.step_logits(2, h1, d2)
            d3 = heads.vocab_ids[logits2.argmax(-1)]
    r1, r1b, r1c, r2 = d1 == y[:, 0], d1b == y[:, 0], d1c == y[:, 0], d2 == y[:, 1]
    chain2 = 1 + r1.float() + (r1 & r2).float()
    if depth == 2:
        sib = 1 + (r1 | r1b).float()
        rows = [("chain (step 0, step 1)", chain2), ("siblings (step 0 top-2)", sib),
                ("oracle: best of the two per position", torch.maximum(chain2, sib))]
        for scale in (0.5, 1.0, 1.5, 2.0):
            use_sib = p[:, 1] > scale * p[:, 0] * q1
            rows.append((f"rule p2 > {scale} * p1 * q1 ({float(use_sib.float().mean()):.0%} siblings)",
                         torch.where(use_sib, sib, chain2)))
    else:
        r3 = d3 == y[:, 2]
        chain3 = chain2 + (r1 & r2 & r3).float()
        chain2_sib = chain2 + (~r1 & r1b).float()
        top3 = 1 + (r1 | r1b | r1c).float()
        rows = [("chain (steps 0, 1, 2)", chain3), ("chain (steps 0, 1) + step 0 runner-up", chain2_sib),
                ("siblings (step 0 top-3)", top3),
                ("oracle: best of the three per position", torch.maximum(torch.maximum(chain3, chain2_sib), top3))]
    print(f"{len(f)} own-eval positions; tau per {args.rows}-row cycle ({args.rows - 1} drafts):")
    for name, tau in rows:
        print(f"  {name:<48} {float(tau.mean()):.4f}")


def dynamic_trees(args):
    """Heads-only trees built from the heads' own probabilities (EAGLE-2's dynamic tree), on
    the own-generation eval set: at each chain step the `--beam` most likely nodes so far
    (product of the head probabilities along their path) are expanded by their `--children`
    most likely next tokens; the tree is the N most likely nodes of all expanded ones (a
    child is never more likely than its parent, so they form a tree). Prints tau for N =
    1..--max-nodes drafts against the chain of the same N, the calibration of the path
    probability (mean predicted vs accepted), and with --costs (verify cost of 1..W rows
    in AR steps) the N that maximises tau per cost."""
    torch.set_num_threads(args.threads)
    model, _ = load_default_model_and_tokenizer()
    from hf_selfspec.heads.top_repo import load_top_heads

    heads = load_top_heads(args.heads, model)
    D = heads.config.depth
    f, x, y, agree = examples(torch.load(FEATURES / "own_eval.pt"), D)
    sel = agree.all(1)
    f, x, y = f[sel].to(heads.out_norm.dtype), x[sel], y[sel]
    P, B, K = len(f), args.beam, args.children
    cand_score, cand_flag, cand_depth = [], [], []
    with torch.no_grad():
        h = f[:, None]  # [P, n, H] frontier states
        tok = x[:, :1]  # [P, n] frontier tokens
        score = torch.ones(P, 1)
        flag = torch.ones(P, 1, dtype=torch.bool)  # the node is on the model's path
        for d in range(D):
            n = h.shape[1]
            hd, logits = heads.step_logits(d, h.reshape(P * n, -1), tok.reshape(-1))
            probs = torch.softmax(logits.float(), -1)
            p, idx = probs.topk(K, -1)  # [P*n, K]
            child_tok = heads.vocab_ids[idx].reshape(P, n * K)
            child_score = (score[:, :, None] * p.reshape(P, n, K)).reshape(P, n * K)
            child_flag = (flag[:, :, None].expand(P, n, K).reshape(P, n * K)
                          & (child_tok == y[:, d:d + 1]))
            cand_score.append(child_score)
            cand_flag.append(child_flag)
            cand_depth.append(torch.full_like(child_score, d))
            keep = child_score.topk(min(B, n * K), -1).indices  # [P, b]
            h = hd.reshape(P, n, -1)[torch.arange(P)[:, None], keep // K]
            tok, score, flag = child_tok.gather(1, keep), child_score.gather(1, keep), child_flag.gather(1, keep)
    s, fl, dp = torch.cat(cand_score, 1), torch.cat(cand_flag, 1), torch.cat(cand_depth, 1)
    order = torch.argsort(-(s - dp * 1e-7), dim=1)  # most likely first, parents before children on ties
    fl_sorted, s_sorted = fl.gather(1, order).float(), s.gather(1, order)
    tau = 1 + fl_sorted.cumsum(1).mean(0)  # tau with the first N nodes
    pred = 1 + s_sorted.cumsum(1).mean(0)
    # the chain of N drafts (top-1 at every step, what the chain decoder drafts)
    with torch.no_grad():
        hc, prev, alive, chain_tau = f, x[:, 0], torch.ones(P, dtype=torch.bool), [1.0]
        for d in range(D):
            hc, logits = heads.step_logits(d, hc, prev)
            prev = heads.vocab_ids[logits.argmax(-1)]
            alive = alive & (prev == y[:, d])
            chain_tau.append(chain_tau[-1] + float(alive.float().mean()))
    costs = [float(c) for c in args.costs.split(",")] if args.costs else None
    print(f"{P} own-eval positions, depth {D}, beam {B}, children {K}")
    print("| drafts N | tree tau | predicted (path prob.) | chain tau | tree tau / cost |")
    print("|---|---|---|---|---|")
    for N in range(1, min(args.max_nodes, s.shape[1]) + 1):
        chain = f"{chain_tau[N]:.3f}" if N <= D else "-"
        per_cost = (f"{float(tau[N - 1]) / costs[N + 1]:.3f}" if costs and N + 1 < len(costs) else "-")
        print(f"| {N} | {float(tau[N - 1]):.3f} | {float(pred[N - 1]):.3f} | {chain} | {per_cost} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--seconds", type=float, default=600)
    c.add_argument("--eval-seconds", type=float, default=120)
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--part", type=int, default=0,
                   help="0: eval + first training part; N > 0: a further training part (train{N}.pt)")
    c.set_defaults(func=collect)
    o = sub.add_parser("collect-own", help="the model's own batched greedy replies (own_train.pt, own_eval.pt)")
    o.add_argument("--seconds", type=float, default=1800)
    o.add_argument("--eval-seconds", type=float, default=300)
    o.add_argument("--batch", type=int, default=16)
    o.add_argument("--max-new", type=int, default=192)
    o.add_argument("--max-prompt", type=int, default=384)
    o.add_argument("--threads", type=int, default=2)
    o.add_argument("--part", type=int, default=0,
                   help=f"0: eval + first training part; N > 0: more training data (prompts from {OWN_PART_STRIDE}*N on)")
    o.set_defaults(func=collect_own)
    tr = sub.add_parser("trees", help="chain vs siblings at the same 3- or 4-row width (own eval set)")
    tr.add_argument("--rows", type=int, choices=[3, 4], default=3)
    tr.add_argument("--heads", default=str(Path(__file__).resolve().parent.parent / "hf_selfspec" / "default_heads"))
    tr.add_argument("--threads", type=int, default=2)
    tr.set_defaults(func=trees)
    dt = sub.add_parser("dyn-trees", help="heads-only trees from the heads' path probabilities (own eval set)")
    dt.add_argument("--beam", type=int, default=4)
    dt.add_argument("--children", type=int, default=4)
    dt.add_argument("--max-nodes", type=int, default=7)
    dt.add_argument("--costs", default="", help="verify cost of 0..W rows in AR steps, e.g. 0,1,1.10,1.19,1.19,1.3,1.35,1.4,1.44")
    dt.add_argument("--heads", default=str(Path(__file__).resolve().parent.parent / "hf_selfspec" / "default_heads"))
    dt.add_argument("--threads", type=int, default=2)
    dt.set_defaults(func=dynamic_trees)
    t = sub.add_parser("train")
    t.add_argument("--depth", type=int, default=2)
    t.add_argument("--adapter", type=int, default=512)
    t.add_argument("--vocab", type=int, default=8192)
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--batch", type=int, default=256)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--weight-decay", type=float, default=0.05)
    t.add_argument("--threads", type=int, default=2)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default=None)
    t.add_argument("--data", choices=["tf", "own", "both"], default="tf",
                   help="tf: teacher-forced ShareGPT replies; own: the model's own greedy replies; both")
    t.add_argument("--max-positions", type=int, default=0, help="subsample training positions (0: all)")
    t.add_argument("--parts", default=None, help="train on these collected parts only, e.g. '2' or '0,1' (default: all)")
    t.add_argument("--init", default=None, help="fine-tune these top heads (a folder) instead of new ones")
    t.add_argument("--new-steps-only", action="store_true",
                   help="with --init and a larger --depth: train only the added steps")
    t.add_argument("--reproduce", default=None, help="the full command chain, stored for the model card")
    t.add_argument("--loss", choices=["hard", "soft"], default="hard",
                   help="hard: cross-entropy to the model's argmax; soft: to the model's whole "
                        "distribution over the heads' vocabulary (EAGLE's classification loss)")
    t.add_argument("--variant", choices=["chain", "medusa"], default="chain",
                   help="chain: steps see the drafted tokens (shipped); medusa: final state only (study)")
    t.set_defaults(func=train)
    args = ap.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
