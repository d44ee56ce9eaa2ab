// Translation unit that carries the shared precompiled header (see dtrainTargets.cmake).
