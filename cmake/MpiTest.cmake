# add_mpi_test(<target> NP <n>... LABELS <labels>... [TIMEOUT <s>]): registers one CTest
# test per world size, each running `mpirun -np <n> --oversubscribe <target>`.
# Root (CI containers) and container-friendly shared memory are allowed via environment.
set(DTRAIN_MPI_TEST_ENV
  OMPI_ALLOW_RUN_AS_ROOT=1
  OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OMPI_MCA_btl_vader_single_copy_mechanism=none
  OMPI_MCA_rmaps_base_oversubscribe=1
  OMP_NUM_THREADS=1)

function(add_mpi_test target)
  cmake_parse_arguments(ARG "" "TIMEOUT" "NP;LABELS;ARGS" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  foreach(np IN LISTS ARG_NP)
    set(name "${target}_np${np}")
    add_test(NAME ${name}
      COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} --oversubscribe
              ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${target}> ${MPIEXEC_POSTFLAGS} ${ARG_ARGS})
    set_tests_properties(${name} PROPERTIES
      LABELS "${ARG_LABELS};dist"
      TIMEOUT ${ARG_TIMEOUT}
      PROCESSORS ${np}
      ENVIRONMENT "${DTRAIN_MPI_TEST_ENV}")
  endforeach()
endfunction()
