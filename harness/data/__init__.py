"""The inputs both sides read: rows (generated or from local files) and their encoding
(``sources``), image rows (``images``) and tokenizers (``tokenizers``). The controller reads
local inputs with them before anything launches, as the ranks will; nothing here imports the
controller, judge, rank or trainer rooms.
"""
