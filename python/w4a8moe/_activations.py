"""The activations and their integer codes: the one table the package's modules derive theirs
from (the ops' codes, the reference's, the engine drop-in's, the vLLM plugin's, the shape
functions' messages). The codes are vLLM's dynamic_4bit_int_moe's (0-2) plus the library's (3, 4), as
the C++ library defines them (docs/operator.md, "Activations")."""

import enum


class Activation(enum.IntEnum):
    """Activation kinds with the integer codes of vLLM's dynamic_4bit_int_moe."""

    SWIGLUSTEP = 0
    SWIGLUOAI = 1
    SILU = 2
    GELU = 3  # exact erf form
    GELU_TANH = 4  # tanh approximation


#: The names, in code order: "swiglustep", "swigluoai", "silu", "gelu", "gelu_tanh".
NAMES = tuple(a.name.lower() for a in Activation)

#: The codes as the library's messages list them: "0 swiglustep, 1 swigluoai, ...".
CODES_TEXT = ", ".join(f"{a.value} {a.name.lower()}" for a in Activation)

_LOW, _HIGH = min(Activation).value, max(Activation).value


def code_error(code) -> str:
    """The library's sentence for an activation code it does not define."""
    return f"activation: expected a code in [{_LOW}, {_HIGH}] ({CODES_TEXT}), got {code}"


def is_code(code) -> bool:
    return _LOW <= code <= _HIGH


def activation_code(activation) -> int:
    """A name ("silu", "swigluoai", "swiglustep", "gelu", "gelu_tanh", in any case), an
    Activation or an int -> the integer code. Unknown names raise ValueError; unknown integer
    codes are passed on for the op to reject."""
    if isinstance(activation, str):
        try:
            return Activation[activation.upper()].value
        except KeyError:
            raise ValueError(f"activation: expected one of {', '.join(NAMES)}, got "
                             f"'{activation}'") from None
    return int(activation)
