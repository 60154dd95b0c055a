# Sourced by the installers of the Debian packages some tests need, so that they install alike.
#   debian_install WHAT PACKAGE...   apt-get install through sudo unless root; all output on stderr
debian_install() {
  local what=$1 sudo=
  shift
  if [ "$(id -u)" -ne 0 ]; then
    sudo=sudo
  fi
  echo "$what: installing $* from the Debian archive" >&2
  $sudo apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "$@" >&2
}
