"""An image's encode runs beside the engine's steps: the encoder cache starts a tower that encodes asynchronously
(`start` / `poll` / `wait` / `busy`, as the cuda VisionEncoder) and hands its rows to the prefill without a second
encode, and the scheduler admits a sequence only once its images are ready, while the running sequences keep
decoding; with nothing else to run, a step waits for the encode."""

from __future__ import annotations

import numpy as np

from thorgen.runtime.backend import ImageInput, ImageRowCache, ImageSpan, SamplingParams
from thorgen.runtime.engine.kv_manager import KVGeometry, KVManager
from thorgen.runtime.engine.scheduler import Scheduler
from thorgen.runtime.engine.sequence import Sequence

TOKENS, IMAGE_ID = 4, 61


def _image(name: str) -> ImageInput:
    return ImageInput(np.zeros((TOKENS * 9, 768), np.uint8), np.zeros((TOKENS * 9, 2), np.int32), TOKENS, name)


class AsyncTower:
    """A tower whose encodes finish when the test says so (`finish()`)."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.in_pieces: list[bool] = []  # each start's `pieces`
        self.in_flight: ImageInput | None = None
        self.finished = False
        self.sync_encodes = 0

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def start(self, image: ImageInput, pieces: bool = False) -> None:
        assert self.in_flight is None, "one encode in flight at a time"
        self.started.append(image.hash)
        self.in_pieces.append(pieces)
        self.in_flight, self.finished = image, False

    def finish(self) -> None:
        self.finished = True

    def poll(self):
        if self.in_flight is None or not self.finished:
            return None
        image, self.in_flight = self.in_flight, None
        return image.hash, np.full((TOKENS, 8), len(self.started), np.float32)

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


def test_waiting_encodes_every_image_now():
    tower = AsyncTower()
    cache = ImageRowCache(tower)
    assert cache.ready([_image("A"), _image("B")], wait=True)
    assert tower.started == ["A", "B"] and tower.sync_encodes == 0
    assert tower.in_pieces == [False, False]  # nothing else runs: each encode whole


def _scheduler(ready: dict[str, bool], asked: list[tuple[str, bool]]) -> Scheduler:
    def media_ready(seq: Sequence, wait: bool) -> bool:
        asked.append((seq.request_id, wait))
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
