# Sourced by the scripts: environment for running MPI jobs here (root in containers,
# oversubscribed cores, no CMA single-copy which containers often forbid) and one
# intra-op thread per rank unless the caller set it. DTRAIN_JOBS: parallel build and test
# jobs, the cores this process may use (GNU nproc reports OMP_NUM_THREADS when it is set,
# which would make them one).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe="${OMPI_MCA_rmaps_base_oversubscribe:-1}"
export OMPI_MCA_btl_vader_single_copy_mechanism="${OMPI_MCA_btl_vader_single_copy_mechanism:-none}"
DTRAIN_JOBS="${DTRAIN_JOBS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
