"""The EAGLE draft architecture that two families share (EAGLE-3 and P-EAGLE): the draft model, the alignment of
states and labels its objectives train on, the speculators layout of its files, and the family behaviour built on
them. Not a family: nothing here is registered, and no family folder imports another's."""
