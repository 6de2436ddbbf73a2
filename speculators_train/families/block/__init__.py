"""Block drafts: DFlash's backbone (a block of slots over [anchor, masks], the target's states as context keys), its
objective, proposer and files, shared by the `dflash`, `dspark` and `dflash2` families; not a family itself."""
