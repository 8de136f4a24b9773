# Source on a lent GPU machine (issue 19): installs the carried wheels (.whl) into /tmp/site,
# once per machine, and puts them and the repository on PYTHONPATH. See docs/GPU.md.
if [ ! -e /tmp/site/.kvstore-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
    touch /tmp/site/.kvstore-wheels
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
