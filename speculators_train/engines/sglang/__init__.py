"""SGLang: its object (`engine`) and doctor's reading of an export by its loader's rules (`doctor`). It does not run
on this machine: there is no serving check, verify runner or recipe section."""
