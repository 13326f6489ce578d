"""A training rank (through the stages' own `rank_main`) that meets bad input, as every rank of
a stage does at once: a row a reward cannot score, a prompt too long. The ranks meet at a file
barrier first, so that each says its line before torchrun stops the other."""

import os
import time
from pathlib import Path

from stagetrain.errors import StageError
from stagetrain.training.rank import rank_main


def body(spec: dict) -> None:
    here = Path(spec["barrier"])
    (here / os.environ["RANK"]).touch()
    while len(list(here.iterdir())) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)
    raise StageError(f"{spec['file']}:12: reward f: returned 'x'; expected a finite number or None")


if __name__ == "__main__":
    rank_main(body)
