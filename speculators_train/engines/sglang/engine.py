"""SGLang as the stages ask for it: the serve lines of its own format, printed as written (nothing here asks SGLang
whether it serves a draft), and doctor's check of that format by its loader's rules."""

from __future__ import annotations

from typing import ClassVar

from speculators_train.engines.base import Engine


class SGLangEngine(Engine):
    name = "sglang"
    command_prefix = "python -m sglang.launch_server "
    export_formats: ClassVar[tuple[str, ...]] = ("sglang",)
    doctor_check = "doctor:check"


ENGINE = SGLangEngine()
