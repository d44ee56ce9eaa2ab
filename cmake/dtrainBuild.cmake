# dtrain_configure_target(<target>): the compile settings every dtrain target shares
# (warnings for our code, one precompiled header reused by all targets so that
# <torch/torch.h> is parsed once per build, not once per file).
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
  endif()
endfunction()
