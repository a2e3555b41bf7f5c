"""`python -m llmrl.launch TORCHRUN-ARGS`: torchrun (`llmrl train --nproc N` starts it), where a failed rank ends the
launch with its exit code instead of torchrun's traceback of ChildFailedError. Each rank has said why it stopped in
its own line (`llmrl: stopped: ...`, rank 0's for a stop of every rank); a rank that ended by a signal (an OOM kill,
SIGKILL) printed nothing, so that is said here in one line."""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile


def main(argv: list[str]) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its "failed (exitcode: 1)" lines
    logs = tempfile.mkdtemp(prefix="llmrl-torchrun-")  # torchrun's own error files (else a torchelastic_* left in TMPDIR)
    try:
        run(parse_args([f"--log-dir={logs}", *argv]))
    except ChildFailedError as e:
        codes = {rank: failure.exitcode for rank, failure in sorted(e.failures.items())}
        exited = [code for code in codes.values() if code > 0]  # a rank's own exit code (1 stopped, 2 refused)
        # the ranks that torchrun itself ended (SIGTERM, once another had failed) are not news
        signalled = {rank: -code for rank, code in codes.items() if code < 0 and -code != signal.SIGTERM}
        for rank, signum in signalled.items():
            name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else f"signal {signum}"
            print(f"llmrl: rank {rank} ended by {name}" + (" (out of memory?)" if signum == signal.SIGKILL else ""),
                  file=sys.stderr, flush=True)
        return exited[0] if exited else 128 + (min(signalled.values()) if signalled else signal.SIGTERM)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
