"""The worker process: one loaded model, mlx on the process's main thread.

Everything here imports mlx (the server process never imports this package: it spawns
`worker/main.py` by name, `dispatch/launch.py`). Importing the package first loads OpenBLAS for
mlx's CPU matmuls on Linux (`fast_blas.py`), keeps the open-file limit that mlx-lm would
lower (`open_files.py`), and defers modules that mlx-audio imports and
Qwen3-TTS never uses (`deferred.py`: about half of a worker's start on a CPU).
"""

from qwen3_tts_engine.fast_blas import use_fast_blas
from qwen3_tts_engine.open_files import import_mlx_lm
from qwen3_tts_engine.worker.deferred import defer_unused_imports

use_fast_blas()
import_mlx_lm()  # keeps this process's open-file limit (open_files.py)
defer_unused_imports()
