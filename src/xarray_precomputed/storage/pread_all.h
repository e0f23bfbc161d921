/*
 * A range of an open file read at an offset, with no GIL: the loop both local readers need
 * (storage._fileread for chunk files, kvstore._minishard for shard indices and values). pread and
 * an offset ReadFile may return fewer bytes than asked (a signal, or more than one call takes), so
 * the read is repeated until the range is done or the file ends; at most 1 GiB is asked at once,
 * as ReadFile takes a 32-bit count.
 */
#ifndef XP_PREAD_ALL_H
#define XP_PREAD_ALL_H

#include <string.h>
#ifdef _WIN32
#include <windows.h>
typedef HANDLE xp_os_file;
#else
#include <errno.h>
#include <unistd.h>
typedef int xp_os_file;
#endif

#define XP_PREAD_MOST 0x40000000LL

/* Bytes read (fewer than len only where the file ends), or -1 with *oserr set: errno, or
 * GetLastError() on Windows. */
static long long xp_pread_all(xp_os_file f, char *buf, long long len, long long off,
                              unsigned long *oserr)
{
    long long got = 0;
    while (got < len) {
        long long want = len - got > XP_PREAD_MOST ? XP_PREAD_MOST : len - got;
#ifdef _WIN32
        OVERLAPPED ov;
        DWORD n = 0;
        memset(&ov, 0, sizeof ov);
        ov.Offset = (DWORD)((unsigned long long)(off + got) & 0xFFFFFFFFu);
        ov.OffsetHigh = (DWORD)((unsigned long long)(off + got) >> 32);
        if (!ReadFile(f, buf + got, (DWORD)want, &n, &ov)) {
            DWORD e = GetLastError();
            if (e == ERROR_HANDLE_EOF)
                break;
            *oserr = (unsigned long)e;
            return -1;
        }
#else
        ssize_t n = pread(f, buf + got, (size_t)want, (off_t)(off + got));
        if (n < 0) {
            if (errno == EINTR)
                continue;
            *oserr = (unsigned long)errno;
            return -1;
        }
#endif
        if (n == 0)
            break;
        got += (long long)n;
    }
    return got;
}

#endif
