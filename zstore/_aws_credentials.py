"""Credentials for the obstore transport, found as s3fs finds them: botocore's chain.

obstore looks in the ``AWS_*`` variables, a web identity token, a container's endpoint and,
last, the instance metadata service, with ten retries (4.3 s on a machine without one) and
whatever ``AWS_EC2_METADATA_DISABLED`` says. s3fs asks botocore, whose chain also reads the
shared credentials and config files (``~/.aws``) and their profiles (``profile=`` or
``$AWS_PROFILE``), SSO, assumed roles and ``credential_process``, and honours that variable.
A store that names no key of its own therefore gets its credentials from botocore here, so
that a bucket s3fs can read, obstore can read too, and a machine with no credentials says so
as s3fs does (at once where the metadata service is disabled, else after botocore's one try).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from .credentials import no_credentials_error

#: How long obstore keeps credentials that botocore refreshes (assumed roles, SSO, the
#: instance's) before asking again; botocore hands back the same ones until they near expiry.
REFRESH_EVERY = timedelta(minutes=5)


class BotocoreCredentials:
    """An obstore ``credential_provider`` handing out botocore's credentials.

    It pickles as its profile: where it is unpickled (another process or machine), botocore's
    chain is asked again, as s3fs asks it there.
    """

    def __init__(self, credentials: Any, profile: str | None, where: str):
        self._credentials, self._profile, self._where = credentials, profile, where

    def __reduce__(self) -> tuple[Any, tuple[str | None, str]]:
        return _resolved, (self._profile, self._where)

    def __call__(self) -> dict[str, Any]:
        """The current credentials, as obstore's ``S3Credential``."""
        from botocore.credentials import RefreshableCredentials

        if self._credentials is None:  # unpickled where botocore finds none
            profile = f" for profile {self._profile!r}" if self._profile else ""
            raise no_credentials_error(self._where, f"botocore found none in this process{profile}")
        frozen = self._credentials.get_frozen_credentials()
        refreshed = isinstance(self._credentials, RefreshableCredentials)
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token,
                "expires_at": datetime.now(timezone.utc) + REFRESH_EVERY if refreshed else None}


def _resolved(profile: str | None, where: str) -> BotocoreCredentials:
    """:class:`BotocoreCredentials` of ``profile``, found again here (unpickling)."""
    import botocore.exceptions
    import botocore.session

    try:
        credentials = botocore.session.Session(profile=profile).get_credentials()
    except botocore.exceptions.ProfileNotFound:  # said at the first request, not in unpickling
        credentials = None
    return BotocoreCredentials(credentials, profile, where)


def botocore_chain(profile: str | None,
                   where: str) -> tuple[BotocoreCredentials | None, str | None]:
    """(credential provider, the profile's region) from botocore for the store at ``where``.

    ``(None, None)`` without botocore (obstore then searches on its own); raises
    :class:`NoCredentialsError` when botocore's whole chain finds nothing, and the
    ``ProfileNotFound`` of an unknown ``profile`` as a ``ValueError`` naming it.
    """
    try:
        import botocore.exceptions
        import botocore.session
    except ImportError:
        return None, None
    try:
        session = botocore.session.Session(profile=profile)
        credentials = session.get_credentials()
        region = session.get_config_variable("region")
    except botocore.exceptions.ProfileNotFound as exc:
        raise ValueError(f"{where}: {exc}; name a profile of the AWS config or credentials "
                         "file, or pass key= and secret=") from exc
    if credentials is None:
        raise no_credentials_error(where, "botocore found none: not in the environment, the "
                                          "AWS config and credentials files, nor from the machine")
    return BotocoreCredentials(credentials, profile, where), region
