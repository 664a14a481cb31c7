"""The docs against the code: the README stays a front door, every relative link and anchor
resolves, every module path the docs name exists, every Python package is on the architecture
page, and measured numbers live on one page (docs/benchmarks.md), each table with its stamp.

Files only: no network, no imports of the packages; git is asked (once) whether the commits the
benchmark stamps name exist, where the checkout has its history.
"""

from __future__ import annotations

import fnmatch
import os
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest


def _repo() -> Path:
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "docs").is_dir():
            return parent
    raise RuntimeError("no repository root above this test")


REPO = _repo()
DOCS = REPO / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
CONFIGURATION = DOCS / "configuration.md"  # generated settings tables (test_settings.py)
ARCHITECTURE = DOCS / "architecture.md"
PACKAGE_READMES = [
    REPO / "engine" / "README.md",
    REPO / "infra" / "README.md",
    REPO / "infra" / "sip" / "README.md",
    *sorted((REPO / "plugins").glob("*/README.md")),
]
ALL_DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md")),
            *PACKAGE_READMES]  # fmt: skip

# Where the code lives (every path a doc names is looked up under these), and what is never ours.
CODE_ROOTS = ("agent", "engine", "plugins", "tests", "scripts", "infra", "docs")
SKIP_DIRS = {"node_modules", "__pycache__", ".venv", ".cache", ".git", ".pytest_cache", "out"}

# The Python packages, by import name, and their folders.
TOP_PACKAGES = {
    "qwen3_tts_engine": REPO / "engine" / "qwen3_tts_engine",
    "voice_agent": REPO / "agent" / "voice_agent",
    **{f"livekit.plugins.{name}": REPO / "plugins" / dist / "livekit" / "plugins" / name
       for dist, name in (("livekit-plugins-qwen3-tts", "qwen3_tts"),
                          ("livekit-plugins-faster-whisper", "faster_whisper"))},
}  # fmt: skip

MACHINE = "Linux x86_64"  # every benchmark table names the machine it was measured on


# -- reading markdown -----------------------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")


def _split(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code-block lines) of a markdown text."""
    prose, code, fenced = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        (code if fenced else prose).append(line)
    return prose, code


def code_texts(text: str) -> list[str]:
    """What the doc shows as code: inline spans and the lines of fenced blocks."""
    prose, code = _split(text)
    spans = [m.group(2) for line in prose for m in INLINE_CODE.finditer(line)]
    return spans + code


def prose_without_code(text: str) -> list[str]:
    prose, _ = _split(text)
    return [INLINE_CODE.sub(" ", line) for line in prose]


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces to '-',
    and a repeated heading gets -1, -2..."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _split(text)[0]:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text: str) -> list[str]:
    return [target for line in prose_without_code(text) for target in LINK.findall(line)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # fmt: skip


# -- the repository's files -----------------------------------------------------------------------


@cache
def repo_paths() -> tuple[frozenset[str], frozenset[str]]:
    """(files, folders) under the code roots, as posix paths relative to the repository."""
    files = set()
    for root in CODE_ROOTS:
        for here, subdirs, names in os.walk(REPO / root):
            subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            rel = Path(here).relative_to(REPO).as_posix()
            files.update(f"{rel}/{n}" for n in names)
    # a folder counts when it holds a file (a folder left with only __pycache__ does not)
    dirs = {parent.as_posix() for f in files for parent in Path(f).parents if parent != Path(".")}
    return frozenset(files), frozenset(dirs)


def _named(path: str, candidates: frozenset[str]) -> bool:
    """Whether `path` (a repository path, or the tail of one, or a bare name; `*` globs) is one
    of `candidates`."""
    if path.split("/")[0] in CODE_ROOTS:
        return any(fnmatch.fnmatchcase(c, path) for c in candidates)
    return any(fnmatch.fnmatchcase(c, "*/" + path) for c in candidates)


PY_PATH = re.compile(r"(?<![\w./*-])([\w./*-]*[\w*]\.py)(?![\w])(::\w+)?")
DOTTED = re.compile(r"(?<![\w.])(qwen3_tts_engine|voice_agent|livekit\.plugins\.\w+)((?:\.\w+)*)")
FOLDER = re.compile(r"(?<![\w./~$-])((?:[\w-]+/)+)(?![\w.*/-])")


def missing_paths(code: str) -> list[str]:
    """The module paths, dotted module names and package folders in a piece of doc code that
    name nothing in the repository."""
    files, dirs = repo_paths()
    known_folder_names = {d.rsplit("/", 1)[-1] for d in dirs}
    missing = []
    for m in PY_PATH.finditer(code):
        path, attr = m.group(1).removeprefix("./"), m.group(2)
        if not _named(path, files):
            missing.append(path)
        elif attr:  # `tests/conftest.py::tiny_checkpoint`: the name is in that file
            pattern = path if path.split("/")[0] in CODE_ROOTS else "*/" + path
            found = [f for f in files if fnmatch.fnmatchcase(f, pattern)]
            if not any(re.search(rf"\b{attr[2:]}\b", (REPO / f).read_text()) for f in found):
                missing.append(m.group(0))
    for m in DOTTED.finditer(code):
        top, rest = m.group(1), [p for p in m.group(2).split(".") if p]
        if top not in TOP_PACKAGES:
            continue  # another package's plugin (livekit.plugins.silero...)
        where = TOP_PACKAGES[top]
        while rest and (where / rest[0]).is_dir():
            where = where / rest.pop(0)
        if rest and (where / f"{rest[0]}.py").is_file():
            module = where / f"{rest.pop(0)}.py"
            # an attribute after the module: defined (or at least named) in it
            if rest and not re.search(rf"\b{rest[0]}\b", module.read_text()):
                missing.append(m.group(0))
        elif rest:
            missing.append(m.group(0))
    for m in FOLDER.finditer(code):
        folder = m.group(1).rstrip("/")
        if folder.split("/")[0] not in {*CODE_ROOTS, *known_folder_names}:
            continue  # not a folder of ours (out/, a URL's path...)
        if not _named(folder, dirs):
            missing.append(m.group(1))
    return missing


# -- 1. the README is a front door ----------------------------------------------------------------


def test_readme_is_at_most_200_lines():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move a topic to docs/"


# -- 2. links and anchors -------------------------------------------------------------------------


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_and_anchors_resolve(doc):
    problems = []
    for target in relative_links(doc.read_text()):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in github_anchors(dest.read_text()):
            problems.append(f"{target}: no heading with that anchor in {dest.name}")
    assert not problems, f"{doc.relative_to(REPO)}: " + "; ".join(problems)


def test_the_anchor_rule():
    text = "# Top\n## On the CPU: kernels, BLAS\n## The agent: `agent/voice_agent`\n## Top\n"
    assert github_anchors(text) == {"top", "on-the-cpu-kernels-blas", "the-agent-agentvoice_agent",
                                    "top-1"}  # fmt: skip


# -- 3. module paths named in the docs ------------------------------------------------------------


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_module_paths_in_code_exist(doc):
    missing = [p for code in code_texts(doc.read_text()) for p in missing_paths(code)]
    assert not missing, f"{doc.relative_to(REPO)} names what does not exist: {sorted(set(missing))}"


def test_the_path_matcher_is_strict_but_not_fooled_by_prose():
    assert missing_paths("engine/qwen3_tts_engine/worker/scheduler.py worker/scheduler.py") == []
    assert missing_paths("qwen3_tts_engine.worker.scheduler voice_agent.harness.demo") == []
    assert missing_paths("test_scheduler.py tests/conftest.py::tiny_checkpoint lab/soak/") == []
    assert missing_paths("qwen3_tts_engine.worker.deferred.DEFERRED_IMPORTS") == []
    assert missing_paths("out/reply.wav ~/.cache/qwen3-tts/ /v1/audio/speech .cache/bin/") == []
    assert missing_paths("serving/ (the HTTP layer) and infra/k8s/") == []
    assert missing_paths("livekit.plugins.silero mlx-audio https://example.com/a/") == []
    assert missing_paths("worker/schedular.py") == ["worker/schedular.py"]
    assert missing_paths("engine/qwen3_tts_engine/runtime/") == ["engine/qwen3_tts_engine/runtime/"]
    assert missing_paths("qwen3_tts_engine.runtime.engine") == ["qwen3_tts_engine.runtime.engine"]
    assert missing_paths("conftest.py::no_such_fixture") == ["conftest.py::no_such_fixture"]
    # a path from the repository's root is taken as it is written
    assert missing_paths("tests/test_scheduler.py") == ["tests/test_scheduler.py"]


# -- 4. every package on the architecture page ----------------------------------------------------


def python_packages() -> list[tuple[str, Path]]:
    found = []
    for top, folder in TOP_PACKAGES.items():
        for here, subdirs, names in os.walk(folder):
            subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
            if "__init__.py" in names:
                rel = Path(here).relative_to(folder).parts
                found.append((".".join((top, *rel)), Path(here)))
    return found


def test_every_package_is_on_the_architecture_page():
    page = ARCHITECTURE.read_text()
    packages = python_packages()
    assert len(packages) >= 10, packages
    missing = []
    for dotted, folder in packages:
        name = dotted.rsplit(".", 1)[-1]
        if folder in TOP_PACKAGES.values():
            named = re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", page)
        else:  # a subpackage: `name/` (a folder in a table or tree) or its dotted name
            named = re.search(rf"(?<![\w-]){re.escape(name)}/", page) or dotted in page
        if not named:
            missing.append(dotted)
    assert not missing, f"docs/architecture.md does not name these packages: {missing}"


# -- 5. measured numbers live in docs/benchmarks.md -----------------------------------------------

# Words that make a sentence a measurement ("faster" but not faster-whisper).
MEASURED = re.compile(r"\b(measured|measures?|p50|p95|median|took|slower|faster(?![-_]whisper)|"
                      r"frames/s|GFLOP/s|word error|RSS|real-time factor)\b", re.I)  # fmt: skip
_N = r"\d+(?:\.\d+)?"
# a number (or a range) with a unit; x and × stick to the number ("1.6x"), the others may not
_UNIT = r"(?:\s?(?:ms|µs|s|%|MB|GB|MiB|GiB|KB|kB|dB|frames/s|GFLOP/s)(?![\w/])|[x×](?!\w))"
WITH_UNIT = re.compile(rf"(?<![\w.]){_N}(?:\s?(?:–|-|to)\s?[~≈]?{_N})?{_UNIT}")
# Numbers that sit next to a measurement word without being a measurement: properties of the
# model and the protocol, and the bounds a benchmark is judged by (they are not measured).
NOT_MEASUREMENTS = {
    "12.5",  # codec frames per second of Qwen3-TTS
    "80",  # ms: one codec frame
    "320",  # ms: one 4-frame chunk
    "100",  # ms: the swap goal (within a plain load + 100 ms)
    "60",  # ms: the glue goal
}


def measurement_units(text: str) -> list[str]:
    """Sentences and table rows of a doc's prose (code left out)."""
    units, paragraph = [], []
    for line in [*prose_without_code(text), ""]:
        starts_new = (not line.strip() or line.lstrip().startswith(("|", "- ", "* ", "#"))
                      or re.match(r"\s*\d+\. ", line))  # fmt: skip
        if starts_new and paragraph:
            units += re.split(r"(?<=[.!?;])\s+(?=[A-Z(*\"“])", " ".join(paragraph))
            paragraph = []
        if line.lstrip().startswith("|"):
            units.append(line)
        elif line.strip():
            paragraph.append(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.strip()))
    return units


def unbacked_numbers(text: str, backed: set[str]) -> list[str]:
    bad = []
    for unit in measurement_units(text):
        if not MEASURED.search(unit):
            continue
        for m in WITH_UNIT.finditer(unit):
            numbers = re.findall(_N, m.group(0))
            if any(n not in backed and n not in NOT_MEASUREMENTS for n in numbers):
                bad.append(f"{m.group(0)!r} in: {unit.strip()[:120]}")
    return bad


@cache
def backed_numbers() -> set[str]:
    """Numbers on the benchmarks page, and the settings' defaults (configuration.md)."""
    numbers = set(re.findall(_N, BENCHMARKS.read_text()))
    return numbers | set(re.findall(_N, CONFIGURATION.read_text()))


@pytest.mark.parametrize("doc", [d for d in ALL_DOCS if d not in (BENCHMARKS, CONFIGURATION)],
                         ids=lambda p: p.relative_to(REPO).as_posix())  # fmt: skip
def test_measured_numbers_are_on_the_benchmarks_page(doc):
    bad = unbacked_numbers(doc.read_text(), backed_numbers())
    assert not bad, (f"{doc.relative_to(REPO)} quotes measured numbers that docs/benchmarks.md "
                     "does not have (move the measurement there, stamped, and link to it): "
                     + "; ".join(bad))  # fmt: skip


def test_the_number_check_sees_measurements_only():
    backed = {"0.43"}
    assert unbacked_numbers("The final came 0.43 s after the speech, measured.", backed) == []
    assert unbacked_numbers("Measured: a pass takes 0.61 s.", backed) != []
    assert unbacked_numbers("| p95 | 1.6x |", backed) != []
    assert unbacked_numbers("The VAD waits 0.61 s of silence.", backed) == []  # a setting
    assert unbacked_numbers("faster-whisper pads a pass to 30 s.", backed) == []


# -- the benchmark tables carry their stamps ------------------------------------------------------

# Tables on the benchmarks page that describe rather than measure.
DESCRIPTIVE_TABLES = {"| fault | how | recovered when |"}
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")


def benchmark_tables() -> list[tuple[str, str]]:
    """(header row, its context: the text from the previous heading to the table's end)."""
    lines = _split(BENCHMARKS.read_text())[0]
    tables, since_heading, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            since_heading = []
        if line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            tables.append((line, "\n".join(since_heading + lines[i:j])))
            since_heading += lines[i:j]
            i = j
            continue
        since_heading.append(line)
        i += 1
    return tables


def test_every_benchmark_table_has_commit_machine_and_command():
    tables = benchmark_tables()
    assert len(tables) >= 20
    problems = []
    for header, context in tables:
        if header in DESCRIPTIVE_TABLES:
            continue
        if not COMMIT.search(context):
            problems.append(f"{header}: no commit")
        if MACHINE not in context:
            problems.append(f"{header}: no machine ({MACHINE!r})")
        command = re.search(r"`[^`]*(\.venv/bin/|python|pytest)[^`]*`", context)
        if not (command or "not recorded" in context):
            problems.append(f"{header}: no command (or 'not recorded')")
    assert not problems, "; ".join(problems)


def test_the_stamped_commits_exist():
    commits = sorted(set(COMMIT.findall(BENCHMARKS.read_text())))
    git = ["git", "-C", str(REPO)]
    # Without git, or in a shallow clone, there is no history to look the commits up in: a skip
    # locally, and under CI a failure (tests/conftest.py), since CI clones the whole history.
    try:
        shallow = subprocess.run([*git, "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"git cannot be asked for the stamped commits: {e}")
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip(
            f"no full git history to find the stamped commits in ({shallow.stderr.strip() or 'a shallow clone'})"
        )
    asked = "".join(f"{c}^{{commit}}\n" for c in commits)
    out = subprocess.run([*git, "cat-file", "--batch-check"], input=asked, capture_output=True,
                         text=True, timeout=60).stdout  # fmt: skip
    missing = [line.split()[0] for line in out.splitlines() if line.endswith("missing")]
    assert not missing, f"docs/benchmarks.md stamps commits that do not exist: {missing}"
