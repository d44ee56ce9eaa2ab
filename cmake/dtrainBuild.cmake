# dtrain_configure_target(<target>): the compile settings every dtrain target shares
# (warnings for our code, one precompiled header reused by all targets so that
# <torch/torch.h> is parsed once per build, not once per file).
#
# The precompiled header is large (hundreds of MB): loading it costs a translation unit
# about 10 s, more than a light file takes to compile on its own. So only the sources
# that include ATen/ATen.h or the LibTorch C++ frontend (<torch/...>), directly or through
# the project's own headers, use it; the others (core, mesh, schedules, the launcher, ...)
# compile without it. The scan follows #include "dtrain/..." and "<dir>/..." quotes into
# include/ and src/, and absolute ones (generated wrappers), at configure time.
set(DTRAIN_WARNINGS -Wall -Wextra -Wno-unused-parameter)

if(DTRAIN_USE_PCH)
  # A tiny object library that owns the precompiled header; every target reuses it.
  add_library(dtrain_pch OBJECT cmake/pch.cpp)
  target_link_libraries(dtrain_pch PUBLIC ${TORCH_LIBRARIES} nlohmann_json::nlohmann_json)
  target_compile_options(dtrain_pch PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${DTRAIN_WARNINGS}>)
  if(DTRAIN_WITH_MPI)
    target_link_libraries(dtrain_pch PUBLIC MPI::MPI_CXX)
    target_compile_definitions(dtrain_pch PUBLIC DTRAIN_WITH_MPI=1)
  endif()
  if(DTRAIN_WITH_CUDA)
    target_link_libraries(dtrain_pch PUBLIC NCCL::NCCL CUDA::cudart)
    target_compile_definitions(dtrain_pch PUBLIC DTRAIN_WITH_CUDA=1)
  endif()
  target_precompile_headers(dtrain_pch PRIVATE
    <torch/torch.h> <nlohmann/json.hpp> <vector> <string> <memory>)
endif()

# _dtrain_heavy(<file> <out>): TRUE when <file> includes <ATen/ATen.h> or <torch/...>,
# itself or through a project header (memoised in global properties).
function(_dtrain_heavy file out)
  get_property(known GLOBAL PROPERTY "dtrain_heavy:${file}" SET)
  if(known)
    get_property(v GLOBAL PROPERTY "dtrain_heavy:${file}")
    set(${out} ${v} PARENT_SCOPE)
    return()
  endif()
  set_property(GLOBAL PROPERTY "dtrain_heavy:${file}" FALSE)  # cycles end here
  set(heavy FALSE)
  if(EXISTS "${file}")
    file(STRINGS "${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*[<\"]")
    get_filename_component(dir "${file}" DIRECTORY)
    foreach(line IN LISTS lines)
      if(line MATCHES "<(ATen/ATen\\.h|torch/[^>]+)>")
        set(heavy TRUE)
        break()
      endif()
      if(line MATCHES "\"([^\"]+)\"")
        set(name "${CMAKE_MATCH_1}")
        if(IS_ABSOLUTE "${name}")  # a generated wrapper's include of a source (tests: emulated_ops)
          set(candidates "${name}")
        else()
          set(candidates)
          foreach(root "${dir}" "${PROJECT_SOURCE_DIR}/include" "${PROJECT_SOURCE_DIR}/src"
                       "${PROJECT_SOURCE_DIR}/tests" "${PROJECT_SOURCE_DIR}/tests/dist"
                       "${PROJECT_SOURCE_DIR}/benchmarks")
            list(APPEND candidates "${root}/${name}")
          endforeach()
        endif()
        foreach(path IN LISTS candidates)
          if(EXISTS "${path}")
            _dtrain_heavy("${path}" sub)
            if(sub)
              set(heavy TRUE)
            endif()
            break()
          endif()
        endforeach()
        if(heavy)
          break()
        endif()
      endif()
    endforeach()
  endif()
  set_property(GLOBAL PROPERTY "dtrain_heavy:${file}" ${heavy})
  set(${out} ${heavy} PARENT_SCOPE)
endfunction()

function(dtrain_configure_target tgt)
  target_compile_options(${tgt} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${DTRAIN_WARNINGS}>)
  if(DTRAIN_USE_PCH)
    target_precompile_headers(${tgt} REUSE_FROM dtrain_pch)
    get_target_property(_type ${tgt} TYPE)
    if(_type STREQUAL "EXECUTABLE")
      # The shared PCH is built -fPIC; executables would get -fPIE and reject it.
      set_target_properties(${tgt} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
      target_compile_options(${tgt} PRIVATE -fPIC)
    endif()
    get_target_property(_sources ${tgt} SOURCES)
    get_target_property(_dir ${tgt} SOURCE_DIR)
    foreach(src IN LISTS _sources)
      if(src MATCHES "^\\$<" OR NOT src MATCHES "\\.(cpp|cc|cxx)$")
        continue()
      endif()
      get_filename_component(path "${src}" ABSOLUTE BASE_DIR "${_dir}")
      _dtrain_heavy("${path}" heavy)
      if(NOT heavy)
        set_source_files_properties("${src}" TARGET_DIRECTORY ${tgt} PROPERTIES SKIP_PRECOMPILE_HEADERS ON)
      endif()
    endforeach()
  endif()
endfunction()
