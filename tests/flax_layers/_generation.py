"""What an eos-ended `generate` returns, from the tokens of the same call without an eos id."""
import numpy as np


def ended_at_eos(free, eos: int, pad: int) -> np.ndarray:
    """free (batch, new_tokens): each row up to and with its first eos, pad after it."""
    ended = np.array(free)
    for row in ended:
        if (row == eos).any():
            row[int(np.argmax(row == eos)) + 1:] = pad
    return ended
