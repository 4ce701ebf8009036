/* What a process sees of the node through the driver API: devices (as CUDA_VISIBLE_DEVICES and
 * NVIDIA_VISIBLE_DEVICES leave them), their identity and attributes, and what calls return
 * before cuInit, without a context, and on a lost GPU.
 *
 *   cuda_query [--ctx]     --ctx: also retain each device's primary context and read cuMemGetInfo
 */
#include <string.h>

#include "cuda_test.h"

int main(int argc, char **argv) {
    int with_ctx = argc > 1 && strcmp(argv[1], "--ctx") == 0;
    int count = -1;
    printf("before_init=%d\n", (int)cuDeviceGetCount(&count));
    int version = 0;
    CK(cuDriverGetVersion(&version));
    printf("driver_version=%d\n", version);
    CUresult rc = cuInit(0);
    printf("init=%d\n", (int)rc);
    if (rc != CUDA_SUCCESS) return 0;
    CK(cuDeviceGetCount(&count));
    printf("count=%d\n", count);
    CUdeviceptr p;
    printf("alloc_without_ctx=%d\n", (int)cuMemAlloc(&p, 1024));
    CUdevice bad;
    printf("get_bad_ordinal=%d\n", (int)cuDeviceGet(&bad, count));
    for (int i = 0; i < count; i++) {
        CUdevice dev;
        CK(cuDeviceGet(&dev, i));
        char name[128], bus[32];
        CUuuid uuid;
        size_t mem;
        int sms, major, minor, pbus, pdev, pdom;
        CK(cuDeviceGetName(name, sizeof name, dev));
        CK(cuDeviceGetUuid(&uuid, dev));
        CK(cuDeviceTotalMem(&mem, dev));
        CK(cuDeviceGetPCIBusId(bus, sizeof bus, dev));
        CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev));
        CK(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
        CK(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
        CK(cuDeviceGetAttribute(&pbus, CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, dev));
        CK(cuDeviceGetAttribute(&pdev, CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, dev));
        CK(cuDeviceGetAttribute(&pdom, CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, dev));
        CUdevice back = -1;
        CK(cuDeviceGetByPCIBusId(&back, bus));
        printf("dev%d.name=%s\ndev%d.uuid=", i, name, i);
        for (int b = 0; b < 16; b++) printf("%02x", (unsigned char)uuid.bytes[b]);
        printf("\ndev%d.total=%zu\ndev%d.bus_id=%s\ndev%d.sms=%d\ndev%d.cc=%d.%d\n", i, mem, i, bus, i, sms, i, major, minor);
        printf("dev%d.pci=%x:%x:%x\ndev%d.by_bus_id=%d\n", i, pdom, pbus, pdev, i, (int)back);
        if (!with_ctx) continue;
        CUcontext ctx;
        rc = cuDevicePrimaryCtxRetain(&ctx, dev);
        printf("dev%d.retain=%d\n", i, (int)rc);
        if (rc != CUDA_SUCCESS) continue;
        CK(cuCtxSetCurrent(ctx));
        size_t f, t;
        rc = cuMemGetInfo(&f, &t);
        printf("dev%d.meminfo=%d\n", i, (int)rc);
        if (rc == CUDA_SUCCESS) printf("dev%d.free=%zu\n", i, f);
        printf("dev%d.alloc=%d\n", i, (int)cuMemAlloc(&p, 1 << 20));
        printf("dev%d.sync=%d\n", i, (int)cuCtxSynchronize());
    }
    return 0;
}
