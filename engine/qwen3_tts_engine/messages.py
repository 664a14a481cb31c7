"""The pipe contract between the server process and a worker process (`multiprocessing` pipe).

The HTTP contract is `protocol.py`; this is the one inside the engine. Every message is one of
these small dataclasses, pickled whole. The server's side is `dispatch/handler.py`, the worker's
`worker/main.py`. Flow control, per stream: a chunk counts as taken when the server's consumer
asks for the next one (`Taken` carries the count); the worker pauses a stream (out of the batch)
while `MAX_UNTAKEN` chunks it sent are untaken.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Two: a stream makes its next chunk while the consumer handles this one, and at most one chunk
# waits when the consumer stops asking. (With one, every stream would sit out a step after each
# chunk until its Taken came back, and leave and rejoin the batch each time.)
MAX_UNTAKEN = 2


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker loads: sent as the spawn argument, or to a spare worker once it is used."""

    model: str
    variant: str | None = None
    warmup: bool = True
    nice: int = 0  # the worker's niceness while it loads (lowered later by the server)
    max_batch: int = 8
    compute_dtype: str | None = None  # None: the weights' dtype; "auto", "float32"...
    progress: bool = False  # draw download / quantization progress bars on stderr
    # fault injection (tests, drills): every batch step sleeps this long per stream in it, as a
    # slower host would take (dispatch/capacity.py then finds fewer streams in real time)
    step_delay_s: float = 0.0
    # the loop detector (worker/loop_detector.py, its default rules) ends looping sentences
    loop_detector: bool = True


# -- server -> worker ------------------------------------------------------------------------


@dataclass(frozen=True)
class Synthesize:
    id: str
    request: dict  # SpeechRequest.to_dict(), ref_audio left out
    ref_audio: bytes | None = None  # the reference audio's file bytes (wav, flac, mp3)


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class AppendText:
    """More text of a streamed-text synthesis (`SpeechRequest.text_stream`)."""

    id: str
    text: str


@dataclass(frozen=True)
class EndText:
    """A streamed text is complete."""

    id: str


@dataclass(frozen=True)
class Taken:
    id: str
    count: int  # chunks of this stream the consumer has taken so far


@dataclass(frozen=True)
class StepDelay:
    """Fault injection while serving (`POST /v1/engine/fault`): from its next step on, every
    batch step sleeps `seconds` per stream in it (0: off), as `WorkerSpec.step_delay_s`."""

    seconds: float


@dataclass(frozen=True)
class QueryMemory:
    pass


@dataclass(frozen=True)
class Stop:
    pass


# -- worker -> server ------------------------------------------------------------------------


@dataclass(frozen=True)
class SpareReady:
    pid: int  # a spare worker has imported what loading needs; it waits for its WorkerSpec


@dataclass(frozen=True)
class Ready:
    info: dict  # the loaded model (rules.ModelInfo's fields, variant, footprint, memory...)


@dataclass(frozen=True)
class LoadFailed:
    message: str


@dataclass(frozen=True)
class Chunk:
    id: str
    pcm: bytes  # s16le mono at 24 kHz
    frames: int
    compute_s: float


@dataclass(frozen=True)
class TextCommitted:
    id: str
    tokens: int  # text tokens of a streamed text committed so far (tokenizer-stable)


@dataclass(frozen=True)
class Done:
    id: str
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Failed:
    """A stream ended with an error: the client's (`client`, a 4xx) or the engine's (a 5xx)."""

    id: str
    message: str
    client: bool = False
    param: str | None = None


@dataclass(frozen=True)
class MemoryReport:
    memory: dict


@dataclass(frozen=True)
class BatchingReport:
    stats: dict


@dataclass(frozen=True)
class StepTimes:
    """Batch steps since the last report: (streams in the step, seconds) each, on the worker's
    clock; and the underruns since then (chunks made after a listener who started playing at
    the stream's first audio needed them)."""

    steps: tuple[tuple[int, float], ...]
    underruns: int = 0


# What the server's reader thread makes of a worker that is gone (EOF on the pipe).
@dataclass(frozen=True)
class Died:
    exitcode: int | None


ToWorker = (Synthesize | Cancel | Taken | AppendText | EndText | StepDelay | QueryMemory | Stop
            | WorkerSpec)  # fmt: skip
FromWorker = (SpareReady | Ready | LoadFailed | Chunk | TextCommitted | Done | Failed | MemoryReport
              | BatchingReport | StepTimes)  # fmt: skip
