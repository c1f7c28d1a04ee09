"""An image's encode runs beside the engine's steps: the encoder cache starts a tower that encodes asynchronously
(`start` / `poll` / `wait` / `busy`, as the cuda VisionEncoder) and hands its rows to the prefill without a second
encode, and the scheduler admits a sequence only once its images are ready, while the running sequences keep
decoding; with nothing else to run, a step waits for the encode."""

from __future__ import annotations

import numpy as np

from thorgen.runtime.backend import BackendError, ImageInput, ImageRowCache, ImageSpan, SamplingParams
from thorgen.runtime.engine.kv_manager import KVGeometry, KVManager
from thorgen.runtime.engine.scheduler import Scheduler
from thorgen.runtime.engine.sequence import Sequence

TOKENS, IMAGE_ID = 4, 61


def _image(name: str, width: int = 1) -> ImageInput:
    """An image of TOKENS soft tokens on a patch grid `width` patches wide."""
    pos = np.stack(np.divmod(np.arange(TOKENS * 9), width)[::-1], 1).astype(np.int32)
    return ImageInput(np.zeros((TOKENS * 9, 768), np.uint8), pos, TOKENS, name)


class AsyncTower:
    """A tower whose encodes finish when the test says so (`finish()`), `per_encode` images of one grid at a time
    (refusing those named in `bad`)."""

    def __init__(self, per_encode: int | None = None, bad: tuple[str, ...] = ()) -> None:
        self.started: list[str] = []
        self.batches: list[list[str]] = []  # each start's images
        self.in_pieces: list[bool] = []  # each start's `pieces`
        self.in_flight: list[ImageInput] = []
        self.finished = False
        self.sync_encodes = 0
        self.bad = bad
        if per_encode is not None:
            self.images_per_encode = lambda image: per_encode

    def check(self, image: ImageInput) -> None:
        if image.hash in self.bad:
            raise BackendError(f"bad image {image.hash}")

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def start(self, images: list[ImageInput], pieces: bool = False) -> None:
        assert not self.in_flight, "one encode in flight at a time"
        assert len({(i.soft_tokens, int(i.positions[-1, 0])) for i in images}) == 1, "one patch grid an encode"
        self.started += [i.hash for i in images]
        self.batches.append([i.hash for i in images])
        self.in_pieces.append(pieces)
        self.in_flight, self.finished = list(images), False

    def finish(self) -> None:
        self.finished = True

    def poll(self):
        if not self.in_flight or not self.finished:
            return []
        images, self.in_flight = self.in_flight, []
        return [(i.hash, np.full((TOKENS, 8), len(self.batches), np.float32)) for i in images]

    def wait(self):
        self.finished = True
        return self.poll()

    def encode(self, image: ImageInput) -> np.ndarray:
        self.sync_encodes += 1
        return np.zeros((TOKENS, 8), np.float32)


def test_the_cache_starts_one_encode_at_a_time_and_hands_its_rows_over():
    tower = AsyncTower()
    cache = ImageRowCache(tower)
    a, b = _image("A"), _image("B")
    assert not cache.ready([a, b])  # A starts
    assert tower.started == ["A"] and not cache.ready([a, b])  # still running: B waits for the tower
    tower.finish()
    assert not cache.ready([a, b]) and tower.started == ["A", "B"]  # A's rows kept, B started
    tower.finish()
    assert cache.ready([a, b])
    rows = cache.rows(a)
    assert rows[0, 0] == 1 and cache.rows(b)[0, 0] == 2 and tower.sync_encodes == 0  # no second encode
    assert cache.encoded == 2 and cache.rows(a) is rows  # then cached as any encode
    assert tower.in_pieces == [True, True]  # beside running steps: in pieces between them


def test_images_of_one_grid_encode_together_up_to_what_an_encode_takes():
    tower = AsyncTower(per_encode=2)
    cache = ImageRowCache(tower)
    a, b, c, wide = _image("A"), _image("B"), _image("C"), _image("W", width=TOKENS * 9)
    assert not cache.ready([a, wide, b, c])
    assert tower.batches == [["A", "B"]]  # A's grid: B along (the wide one is another grid), two an encode
    tower.finish()
    assert not cache.ready([a, wide, b, c]) and tower.batches[-1] == ["W"]  # the next missing one leads
    tower.finish()
    assert not cache.ready([a, wide, b, c]) and tower.batches[-1] == ["C"]
    tower.finish()
    assert cache.ready([a, wide, b, c])
    assert [cache.rows(i)[0, 0] for i in (a, b, wide, c)] == [1, 1, 2, 3] and tower.sync_encodes == 0
    assert cache.encoded == 4


def test_an_encode_takes_queued_requests_images_along_but_not_a_bad_one():
    tower = AsyncTower(per_encode=4, bad=("X",))
    cache = ImageRowCache(tower)
    a, x, q, other = _image("A"), _image("X"), _image("Q"), _image("O", width=TOKENS * 9)
    assert not cache.ready([a], along=[x, other, q, a])  # another request's bad image stays out of the batch
    assert tower.batches == [["A", "Q"]]
    tower.finish()
    assert cache.ready([a]) and cache.ready([q])  # Q's rows came with A's: no encode of its own
    assert tower.batches == [["A", "Q"]] and cache.rows(q)[0, 0] == 1


def test_the_scheduler_offers_the_queued_image_requests_along():
    ready, asked, along = {"a": False, "b": False}, [], []
    sched = _scheduler(ready, asked, along)
    text = Sequence("t", [2, 5, 6, 7], SamplingParams(), 8)
    sched.add(_image_seq("a"))
    sched.add(text)
    sched.add(_image_seq("b"))
    sched.schedule()
    # a (head): b's images offered along (the text-only request has none); then b, with nothing behind it
    assert asked == [("a", True), ("b", False)] and along == [["b"], []]


def test_waiting_encodes_every_image_now():
    tower = AsyncTower()
    cache = ImageRowCache(tower)
    assert cache.ready([_image("A"), _image("B")], wait=True)
    assert tower.started == ["A", "B"] and tower.sync_encodes == 0
    assert tower.in_pieces == [False, False]  # nothing else runs: each encode whole


def _scheduler(ready: dict[str, bool], asked: list[tuple[str, bool]], along: list | None = None) -> Scheduler:
    along = [] if along is None else along

    def media_ready(seq: Sequence, wait: bool, queued: list[Sequence]) -> bool:
        asked.append((seq.request_id, wait))
        along.append([q.request_id for q in queued])
        return ready[seq.request_id] or wait

    kv = KVManager(KVGeometry(4, 512, 64, prefix_cache=False))
    return Scheduler(kv, max_num_seqs=4, max_step_tokens=512, max_context=512, media_ready=media_ready)


def _image_seq(rid: str) -> Sequence:
    prompt = [2, 10, 11] + [IMAGE_ID] * TOKENS + [12, 13]
    return Sequence(rid, prompt, SamplingParams(), 8, images=(ImageSpan(3, _image(rid)),))


def test_a_sequence_waits_for_its_images_while_the_running_ones_decode():
    ready, asked = {"img": False}, []
    sched = _scheduler(ready, asked)
    text = Sequence("text", [2, 5, 6, 7], SamplingParams(), 8)
    sched.add(text)
    first = sched.schedule()
    assert [p.seq for p in first.prefills] == [text]
    text.num_cached = len(text.prompt)
    sched.kv.prefilled(text, text.num_cached)
    text.output.append(9)
    sched.add(_image_seq("img"))
    step = sched.schedule()
    assert step.decodes == (text,) and not step.prefills  # the image's sequence is not admitted yet
    assert asked[-1] == ("img", False)  # (and the step did not wait for it: a sequence is decoding)
    ready["img"] = True
    step = sched.schedule()
    assert [p.seq.request_id for p in step.prefills] == ["img"] and step.decodes == (text,)


def test_with_nothing_else_to_run_the_step_waits_for_the_encode():
    ready, asked = {"img": False}, []
    sched = _scheduler(ready, asked)
    sched.add(_image_seq("img"))
    step = sched.schedule()
    assert asked == [("img", True)] and [p.seq.request_id for p in step.prefills] == ["img"]


def test_rows_of_the_image_in_flight_wait_for_that_encode():
    tower = AsyncTower()
    cache = ImageRowCache(tower)
    a = _image("A")
    assert not cache.ready([a])  # A's encode is in flight
    assert cache.rows(a)[0, 0] == 1 and tower.started == ["A"] and tower.sync_encodes == 0  # not encoded twice


def test_the_cache_keeps_a_bounded_number_of_images_rows_and_counts_their_bytes():
    from thorgen.runtime.backend import DONE_KEPT

    tower = AsyncTower()
    cache = ImageRowCache(tower, slots=3)
    one = TOKENS * 8 * 4  # an image's rows: [TOKENS, 8] float32
    for i in range(50):  # used at once: each encode's rows go through the LRU of `slots`
        cache.rows(_image(f"used{i}"))
    assert cache.bytes == 3 * one
    for i in range(DONE_KEPT + 20):  # encoded beside the steps and never used (their requests aborted)
        cache.ready([_image(f"aborted{i}")])
        tower.finish()
        cache.ready([_image(f"aborted{i}")])
    assert cache.bytes == (3 + DONE_KEPT) * one
    cache.clear()
    assert cache.bytes == 0
