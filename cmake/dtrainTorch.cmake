# Finds LibTorch. Order: an explicit Torch_DIR / CMAKE_PREFIX_PATH, then the torch wheel
# importable by python3 (torch.utils.cmake_prefix_path). Torch headers become system
# includes so our warnings stay on without drowning in theirs.
# The CUDA code compiles for DTRAIN_CUDA_ARCHITECTURES (CMAKE_CUDA_ARCHITECTURES as given),
# in LibTorch's spelling: 80 -> 8.0, 90a -> 9.0a.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND DTRAIN_CUDA_ARCHITECTURES)
  set(_dtrain_archs)
  foreach(_a IN LISTS DTRAIN_CUDA_ARCHITECTURES)
    string(REGEX REPLACE "-(real|virtual)$" "" _a "${_a}")
    string(REGEX REPLACE "^([0-9]+)([0-9])([a-z]?)$" "\\1.\\2\\3" _a "${_a}")
    list(APPEND _dtrain_archs "${_a}")
  endforeach()
  set(ENV{TORCH_CUDA_ARCH_LIST} "${_dtrain_archs}")
  message(STATUS "dtrain: CUDA architectures ${DTRAIN_CUDA_ARCHITECTURES} (TORCH_CUDA_ARCH_LIST ${_dtrain_archs})")
endif()
if(NOT TARGET torch)
  find_package(Torch QUIET CONFIG)
  if(NOT Torch_FOUND)
    find_program(DTRAIN_PYTHON NAMES python3 python)
    if(DTRAIN_PYTHON)
      execute_process(
        COMMAND "${DTRAIN_PYTHON}" -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
        OUTPUT_VARIABLE _dtrain_torch_prefix OUTPUT_STRIP_TRAILING_WHITESPACE
        RESULT_VARIABLE _dtrain_torch_rc ERROR_QUIET)
      if(_dtrain_torch_rc EQUAL 0)
        list(APPEND CMAKE_PREFIX_PATH "${_dtrain_torch_prefix}")
      endif()
    endif()
    find_package(Torch CONFIG)
    if(NOT Torch_FOUND)
      message(FATAL_ERROR "dtrain: LibTorch not found. Run scripts/setup.sh (installs the torch "
                          "wheel) or pass -DCMAKE_PREFIX_PATH=<libtorch>.")
    endif()
  endif()
  # Mark torch include dirs as system headers.
  foreach(_t torch torch_library torch_cpu c10 torch_cuda c10_cuda)
    if(TARGET ${_t})
      get_target_property(_inc ${_t} INTERFACE_INCLUDE_DIRECTORIES)
      if(_inc)
        set_target_properties(${_t} PROPERTIES INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${_inc}")
      endif()
    endif()
  endforeach()
endif()
