"""Image requests as rows of the text batch: exact alone, batched, with MTP, and across prefix-cache turns.

fp32 tiny Qwen3.5 VLM (random vision tower). An image request's prompt is prepared as the server prepares it
(routing/media_prompt.py: the host's template placeholders, the VLM's processor), then prefilled through the vision
tower and the M-RoPE forward and decoded in the text batch.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import mlx.core as mx
import pytest
from PIL import Image

from vllm_mlx_mtp_routing.model.media_forward import VisionParts
from vllm_mlx_mtp_routing.model.text_model import build_text_model
from vllm_mlx_mtp_routing.prefix_cache.cache import PrefixCache
from vllm_mlx_mtp_routing.routing.media_prompt import MediaPrompt, image_spans, prepare_media_chat
from vllm_mlx_mtp_routing.text_engine.sampling import SamplingOptions
from vllm_mlx_mtp_routing.text_engine.scheduler import BatchScheduler
from vllm_mlx_mtp_routing.text_engine.spec.mtp import MTPDecode
from vllm_mlx_mtp_routing.text_engine.state import TextOutput, TextRequest
from vllm_mlx_mtp_routing.text_engine.step_plan import MediaEncode

PREFILL = 16  # small: image prompts span several chunks, some cut inside an image


@pytest.fixture(scope="module")
def vl(tiny_vlm_fp32: Path):
    from mlx_vlm import load

    vlm, processor = load(str(tiny_vlm_fp32))
    config = json.loads((tiny_vlm_fp32 / "config.json").read_text())
    bundle = build_text_model(vlm, tiny_vlm_fp32, config)
    return vlm, processor, bundle, VisionParts(vlm, config)


def data_url(color: tuple[int, int, int], size: tuple[int, int] = (160, 128), stripe: bool = True) -> str:
    img = Image.new("RGB", size, color)
    if stripe:  # a little structure, so patches differ
        for x in range(0, size[0], 8):
            for y in range(size[1]):
                img.putpixel((x, y), (255 - color[0], color[1], 255 - color[2]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(urls: list[str], text: str = "What is in this picture?") -> list[dict]:
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def prepare(vl, messages: list[dict], positions: bool = False) -> MediaPrompt:
    from vllm_mlx.engine.batched import BatchedEngine

    _, processor, _, vision = vl

    def render(msgs: list[dict], images: int) -> str:
        return processor.apply_chat_template(BatchedEngine._prepare_mllm_messages(msgs), tokenize=False, add_generation_prompt=True)

    return prepare_media_chat(processor, render, messages, image_token_id=vision.image_token_id, merge=vision.merge,
                              positions=positions)


def scheduler(vl, *, decode=None, cache=None, max_num_seqs=4) -> BatchScheduler:
    _, processor, bundle, vision = vl
    return BatchScheduler(bundle.model, processor.tokenizer, max_num_seqs=max_num_seqs, prefill_step_size=PREFILL,
                          decode=decode, prefix_cache=cache, vision=vision)


def run(sched: BatchScheduler, jobs: list) -> dict[int, list[int]]:
    """jobs: [(arrival step, MediaPrompt | token list, max_tokens)] -> {index: greedy tokens}."""
    pending, finals, step = list(range(len(jobs))), {}, 0
    while pending or sched.has_work():
        while pending and jobs[pending[0]][0] <= step:
            i = pending.pop(0)
            _, prompt, n = jobs[i]
            ids, media = (prompt.ids, prompt.media) if isinstance(prompt, MediaPrompt) else (prompt, None)
            marks = prompt.marks if isinstance(prompt, MediaPrompt) else []
            sched.add(TextRequest(str(i), list(ids), SamplingOptions(max_tokens=n), marks, media=media))
        for out in sched.step():
            if out.finished:
                assert out.finish_reason == "length", out.error
                finals[int(out.request_id)] = out.token_ids
        step += 1
    return finals


def finish(sched: BatchScheduler, request: TextRequest) -> TextOutput:
    """Add ``request`` to a scheduler with nothing else to do and step until it ends: its final output."""
    sched.add(request)
    last = None
    while sched.has_work():
        last = next((o for o in sched.step() if o.finished), last)
    assert last is not None
    return last


def alone(vl, prompt, n: int, **kw) -> list[int]:
    return run(scheduler(vl, max_num_seqs=1, **kw), [(0, prompt, n)])[0]


def mlx_vlm_greedy(vl, prompt: MediaPrompt, n: int) -> tuple[list[int], list[mx.array]]:
    """The VLM's own forward for the request alone (its language model with its positions, then its decode)."""
    vlm = vl[0]
    media = prompt.media
    ids = mx.array([prompt.ids])
    grid = mx.array([list(g) for g in media.grid_thw])
    feat = vlm.get_input_embeddings(ids, media.pixel_values, image_grid_thw=grid)
    lm = vlm.language_model
    cache = lm.make_cache()
    out = lm(ids, inputs_embeds=feat.inputs_embeds, cache=cache, position_ids=feat.position_ids)
    tokens, logits = [], []
    for _ in range(n):
        last = out.logits[:, -1]
        logits.append(last)
        t = int(last.argmax().item())
        tokens.append(t)
        out = lm(mx.array([[t]]), cache=cache, rope_deltas=feat.rope_deltas)
    return tokens, logits


def test_image_spans_check_the_runs():
    assert image_spans([1, 9, 9, 2, 9, 9, 9, 3], 9, [2, 3]) == [(1, 3), (4, 7)]
    with pytest.raises(ValueError):
        image_spans([1, 9, 2], 9, [2])
    with pytest.raises(ValueError):
        image_spans([9, 9, 1, 9], 9, [2])


def test_alone_matches_the_vlm_forward(vl):
    prompt = prepare(vl, chat([data_url((200, 30, 30))]))
    assert prompt.media.spans and len(prompt.ids) > 2 * PREFILL  # chunks cut inside the image too
    n = 12
    ours = alone(vl, prompt, n)
    ref, ref_logits = mlx_vlm_greedy(vl, prompt, n)
    if ours != ref:  # only a rounding-level tie may split them
        i = next(k for k, (a, b) in enumerate(zip(ours, ref)) if a != b)
        step = ref_logits[i][0]
        assert abs(step[ours[i]].item() - step[ref[i]].item()) < 1e-4, (i, ours, ref)


def test_batched_beside_text_and_images_equals_alone(vl):
    red = prepare(vl, chat([data_url((220, 20, 20))], "Describe it."))
    two = prepare(vl, chat([data_url((20, 200, 40), (32, 64)), data_url((10, 10, 230))], "Compare these two images, please."))
    text = [int(t) for t in mx.random.randint(10, 3000, (37,), key=mx.random.key(3)).tolist()]
    jobs = [(0, text, 14), (1, red, 10), (1, two, 12), (3, red, 9), (6, text[:5], 11)]
    batched = run(scheduler(vl, max_num_seqs=3), jobs)
    for i, (_, p, n) in enumerate(jobs):
        assert batched[i] == alone(vl, p, n), f"request {i}"


def test_different_images_give_different_outputs(vl):
    outs = {tuple(alone(vl, prepare(vl, chat([data_url(c, stripe=False)])), 8))
            for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]}
    assert len(outs) == 3


def test_mtp_equals_plain(vl):
    bundle = vl[2]
    prompt = prepare(vl, chat([data_url((120, 60, 200))], "Tell me a long story about this image."))
    plain = alone(vl, prompt, 16)
    decode = MTPDecode(bundle.mtp, k=2, adaptive=False)
    sched = scheduler(vl, decode=decode, max_num_seqs=1)
    assert run(sched, [(0, prompt, 16)])[0] == plain
    assert decode.stats()["drafted"] > 0


def test_second_turn_resumes_past_the_same_image_only(vl):
    bundle = vl[2]
    url, other = data_url((30, 140, 90)), data_url((140, 30, 90))
    cache = PrefixCache(bundle.model, 64 * 2**20, with_head=False)
    sched = scheduler(vl, cache=cache)
    turn1 = prepare(vl, chat([url], "What colour dominates?"), positions=True)
    first = run(sched, [(0, turn1, 6)])[0]
    follow = [*chat([url], "What colour dominates?"), {"role": "assistant", "content": "Green."},
              {"role": "user", "content": "And the stripes?"}]
    turn2 = prepare(vl, follow, positions=True)
    # The template renders the generation prompt and a past reply differently: the end of the turn-1 user message is
    # what the two prompts share, a snapshot position of turn 1.
    shared = next(i for i, (a, b) in enumerate(zip(turn1.ids, turn2.ids)) if a != b)
    assert any(pos <= shared and pos > turn1.media.spans[0][1] for pos, _ in turn1.marks), (turn1.marks, shared)
    out = finish(sched, TextRequest("t2", turn2.ids, SamplingOptions(max_tokens=6), turn2.marks, media=turn2.media))
    assert out.cached_tokens > turn1.media.spans[0][1]
    assert out.token_ids == alone(vl, turn2, 6)  # a cold server's output
    assert first == alone(vl, turn1, 6)
    # The same conversation with another image of the same size: no hit past the image's first token.
    swapped = prepare(vl, [*chat([other], "What colour dominates?"), *follow[1:]], positions=True)
    assert swapped.ids == turn2.ids
    last = finish(sched, TextRequest("t3", swapped.ids, SamplingOptions(max_tokens=6), swapped.marks, media=swapped.media))
    assert last.cached_tokens <= swapped.media.spans[0][0]
    assert last.token_ids == alone(vl, swapped, 6)


class OneLayer:
    def piece_end(self, position: int, tokens: int, first: int, scale: float = 1.0, spent_s: float = 0.0) -> int:
        return first + 1

    def piece_s(self, position: int, tokens: int, first: int, end: int) -> float:
        return 0.0


def test_image_chunks_in_pieces_of_layers_equal_alone(vl):
    from vllm_mlx_mtp_routing.text_engine.prefill_budget import ChunkGrid

    red = prepare(vl, chat([data_url((220, 20, 20))], "Describe it."))
    text = [int(t) for t in mx.random.randint(10, 3000, (9,), key=mx.random.key(5)).tolist()]
    sched = scheduler(vl, max_num_seqs=3)
    sched.chunk_grid = ChunkGrid(lambda p: 48)  # chunks that cut inside the image
    sched.prefill_time_s = (1e-9, 1e-9)
    sched.layer_pieces = OneLayer()  # one layer per step while the text row decodes
    pieces, real = [], sched.runner.prefill
    sched.runner.prefill = lambda work: (pieces.extend(w for w in work if getattr(w, "whole", True) is False), real(work))[1]
    batched = run(sched, [(0, text, 30), (1, red, 8)])
    assert pieces and batched[1] == alone(vl, red, 8) and batched[0] == alone(vl, text, 30)


def test_the_vision_tower_in_pieces_of_blocks_gives_the_features_one_call_gives(vl):
    _, _, _, vision = vl
    media = prepare(vl, chat([data_url((30, 160, 90))])).media
    s, e = media.patch_rows(0)
    whole = vision.encode(media.pixel_values[s:e], media.grid_thw[0])
    assert vision.blocks >= 2
    progress = vision.begin_encode(media.pixel_values[s:e], media.grid_thw[0])
    mx.eval(progress.hidden)
    with pytest.raises(RuntimeError):
        vision.finish_encode(progress)  # no block has run
    while progress.next_block < vision.blocks:  # a block a step, each evaluated on its own
        vision.run_blocks(progress, progress.next_block + 1)
        mx.eval(progress.hidden)
    assert mx.array_equal(vision.finish_encode(progress), whole).item()


def test_an_image_encoded_in_pieces_beside_decoding_rows_equals_alone(vl):
    red = prepare(vl, chat([data_url((220, 20, 20))], "Describe it."))
    text = [int(t) for t in mx.random.randint(10, 3000, (9,), key=mx.random.key(7)).tolist()]
    sched = scheduler(vl, max_num_seqs=2)
    sched.prefill_time_s = (1e-9, 0.25)  # a stall bound no block fits: one block a step while the text row decodes
    encodes, real = [], sched.runner.prefill
    sched.runner.prefill = lambda work: (encodes.extend(w for w in work if isinstance(w, MediaEncode)), real(work))[1]
    batched = run(sched, [(0, text, 24), (1, red, 8)])
    blocks = sched.runner.vision_blocks
    # the input stage, then a block a step
    assert [(w.first_block, w.last_block) for w in encodes] == [(0, 0)] + [(b, b + 1) for b in range(blocks - 1)] + [
        (blocks - 1, None)]
    assert sched.stats()["vision_pieces"] == blocks + 1 and sched.stats()["images_encoded"] == 1
    assert batched[1] == alone(vl, red, 8) and batched[0] == alone(vl, text, 24)
    assert not red.media.encoding  # nothing held once the image is encoded


def test_an_encode_begun_in_pieces_finishes_when_the_streams_are_gone(vl):
    red = prepare(vl, chat([data_url((220, 20, 20))], "Describe it."))
    text = [int(t) for t in mx.random.randint(10, 3000, (9,), key=mx.random.key(8)).tolist()]
    sched = scheduler(vl, max_num_seqs=2)
    sched.prefill_time_s = (1e-9, 0.25)
    encodes, real = [], sched.runner.prefill
    sched.runner.prefill = lambda work: (encodes.extend(w for w in work if isinstance(w, MediaEncode)), real(work))[1]
    batched = run(sched, [(0, text, 2), (1, red, 8)])  # the text row leaves right after the image's input stage
    assert [(w.first_block, w.last_block) for w in encodes] == [(0, 0), (0, None)]  # then the rest in one item
    assert batched[1] == alone(vl, red, 8) and not red.media.encoding


def test_a_resent_image_is_taken_from_the_memo_as_the_processor_made_it(vl):
    """A later turn that resends its image (a data: URL) skips the image's decode and processor: its prompt, pixels,
    grid, pixel digest and snapshot positions equal a fresh preparation's, and its greedy output too; another image
    misses."""
    from vllm_mlx_mtp_routing.routing.image_memo import ImageMemo

    _, processor, _, vision = vl
    memo = ImageMemo()
    url, other = data_url((30, 140, 90)), data_url((140, 30, 90))

    def render(msgs: list[dict], images: int) -> str:
        from vllm_mlx.engine.batched import BatchedEngine

        return processor.apply_chat_template(BatchedEngine._prepare_mllm_messages(msgs), tokenize=False, add_generation_prompt=True)

    def with_memo(messages):
        return prepare_media_chat(processor, render, messages, image_token_id=vision.image_token_id, merge=vision.merge,
                                  positions=True, images=memo)

    turn1 = chat([url, other], "Which is greener?")
    with_memo(turn1)
    assert memo.hits == 0 and memo.trusted
    follow = [*turn1, {"role": "assistant", "content": "The first."}, {"role": "user", "content": "And the stripes?"}]
    got, fresh = with_memo(follow), prepare(vl, follow, positions=True)
    assert memo.hits == 1
    assert (got.ids, got.marks, got.media.grid_thw, got.media.spans, got.media.digests) == (
        fresh.ids, fresh.marks, fresh.media.grid_thw, fresh.media.spans, fresh.media.digests)
    assert mx.array_equal(got.media.pixel_values, fresh.media.pixel_values).item()
    assert alone(vl, got, 5) == alone(vl, fresh, 5)
    with_memo(chat([data_url((90, 30, 140))], "Which is greener?"))  # a new image: the processor's work
    assert memo.hits == 1
